//! A forward launch whose operands passed every check, runnable in any tile
//! configuration: what [`Runtime::forward`] queues once and autotuning
//! times per candidate.

use crate::args::{tensor_ptrs, ArgInfo, ArgValue};
use crate::block_mask::BlockMask;
use crate::check::{check_forward, softmax_scale, Problem};
use crate::dropout;
use crate::element::Element;
use crate::error::Error;
use crate::few::Few;
use crate::kernels::Which;
use crate::launch_checks::launch_bound;
use crate::layout::Layout;
use crate::marshal::{launch_config, Bindings};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::runtime::Runtime;
use crate::tma::{self, TensorMaps};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use flashgen_codegen::abi::Operand;
use flashgen_codegen::cuda::{TileConfig, Work};
use flashgen_codegen::{Dropout, Shape, Spec};

/// The operands of one forward pass. O and the optional row log-sum-exp
/// (`f32[batch, heads, q_len]`, contiguous) are written.
pub struct ForwardIo<'a, T> {
    pub q: (&'a dyn DeviceInput<T>, Layout),
    pub k: (&'a dyn DeviceInput<T>, Layout),
    pub v: (&'a dyn DeviceInput<T>, Layout),
    pub o: (&'a mut dyn DeviceOutput<T>, Layout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
}

#[derive(Clone, Copy, Default)]
pub struct ForwardOptions<'a> {
    /// Softmax scale, positive and finite (else `Error::Scale`); `None`
    /// means `1 / sqrt(head_dims.qk)`.
    pub scale: Option<f32>,
    /// Tile classes from [`Runtime::block_mask`] for the same spec, shape,
    /// params and tensors: lets the kernel skip tiles of data-dependent
    /// masks. Without one, only tiles the mask's interval analysis decides
    /// are skipped.
    pub block_mask: Option<&'a BlockMask>,
    /// Launch in this tile configuration, which must be one of
    /// [`tile_choice::candidates`](crate::tile_choice::candidates) for [`Runtime::target`]. `None`: the
    /// choice autotuning remembered for the launch's shape class, else
    /// [`tile_choice::preferred`](crate::tile_choice::preferred) (see [`Runtime::autotune`]).
    pub config: Option<TileConfig>,
    /// Dropout on the attention probabilities (`p` in `[0, 1)`, else
    /// `Error::Dropout`): the kernel with dropout, whose mask is a function
    /// of the seed, offset and each pair's (b, h, q, k) alone, so the
    /// backward given the same one regenerates it. `None` or `p = 0`: none.
    /// Dense launches only (the others return `Error::Dropout`).
    pub dropout: Option<Dropout>,
}

/// A forward launch whose operands passed the checks, ready to queue in any
/// tile configuration as often as needed (autotuning times each candidate on it).
pub(crate) struct ForwardLaunch<'a, 'r, T> {
    /// The spec whose kernel runs: the caller's, or its bounded form
    /// (`crate::bounded_columns`).
    pub spec: &'r Spec,
    /// The caller's spec, which a block mask is built for.
    called: &'r Spec,
    pub shape: Shape,
    io: ForwardIo<'a, T>,
    args: &'r [ArgValue<'r>],
    infos: Few<ArgInfo>,
    scale: f32,
    /// The checked dropout (`None`: none, or p = 0).
    dropout: Option<Dropout>,
}

impl<'a, 'r, T: Element> ForwardLaunch<'a, 'r, T> {
    /// Checks every size, stride, buffer length and argument against `spec`,
    /// and `opts`' softmax scale; `None` for a launch with no batch or no
    /// queries. The kernel is `bounded`'s where given (the same declarations,
    /// the same mask at these arguments).
    pub fn check(
        spec: &'r Spec,
        bounded: Option<&'r Spec>,
        io: ForwardIo<'a, T>,
        args: &'r [ArgValue<'r>],
        opts: &ForwardOptions<'_>,
    ) -> Result<Option<Self>, Error> {
        let scale = softmax_scale(spec, opts.scale)?;
        let dropout = dropout::checked(opts.dropout)?;
        let infos = Few::of(ArgInfo::I32(0), args.iter().map(ArgValue::info));
        let operands = [(io.q.1, io.q.0.len()), (io.k.1, io.k.0.len()), (io.v.1, io.v.0.len()), (io.o.1, io.o.0.len())];
        let problem = Problem::new(T::DTYPE, operands, io.lse.as_ref().map(|l| l.len()));
        let Some(shape) = check_forward(spec, &problem, &infos)? else {
            return Ok(None);
        };
        let called = spec;
        let spec = bounded.unwrap_or(spec);
        Ok(Some(ForwardLaunch { spec, called, shape, io, args, infos, scale, dropout }))
    }

    /// The kernel a launch in `config` runs: see [`tensor_maps`].
    pub(crate) fn which(&self, rt: &Runtime, config: TileConfig) -> Which {
        let stream = rt.stream().as_ref();
        let ForwardIo { q, k, v, o, .. } = &self.io;
        let operands = [
            (Operand::Q, q.1.address(q.0.device_ptr(stream).0), &q.1),
            (Operand::K, k.1.address(k.0.device_ptr(stream).0), &k.1),
            (Operand::V, v.1.address(v.0.device_ptr(stream).0), &v.1),
            (Operand::O, o.1.address(o.0.device_ptr(stream).0), &o.1),
        ];
        let copy = tma::copy_with(&tensor_maps(rt, self.spec, config, &operands));
        Which::forward_with(config, copy, self.dropout.is_some())
    }

    /// Queues the kernel in `config` without waiting for it.
    pub fn run(&mut self, rt: &Runtime, config: TileConfig, opts: &ForwardOptions<'_>) -> Result<(), Error> {
        let (spec, shape, infos) = (self.spec, self.shape, &self.infos);
        let ForwardIo { q: (q, q_layout), k: (k, k_layout), v: (v, v_layout), o: (o, o_layout), lse } = &mut self.io;

        // The guards order the launch after pending work on each buffer and
        // record it for later work; they must live until after the launch.
        let stream = rt.stream().as_ref();
        let (q_ptr, _q) = q.device_ptr(stream);
        let (k_ptr, _k) = k.device_ptr(stream);
        let (v_ptr, _v) = v.device_ptr(stream);
        let (o_ptr, _o) = o.device_ptr_mut(stream);
        let [q_ptr, k_ptr, v_ptr, o_ptr] =
            [(q_ptr, &*q_layout), (k_ptr, &*k_layout), (v_ptr, &*v_layout), (o_ptr, &*o_layout)]
                .map(|(p, l)| l.address(p));
        let lse = lse.as_mut().map(|l| l.device_ptr_mut(stream));
        let operands = [
            (Operand::Q, q_ptr, &*q_layout),
            (Operand::K, k_ptr, &*k_layout),
            (Operand::V, v_ptr, &*v_layout),
            (Operand::O, o_ptr, &*o_layout),
        ];
        let tensor_maps = tensor_maps(rt, spec, config, &operands);
        let which = Which::forward_with(config, tma::copy_with(&tensor_maps), self.dropout.is_some());
        // The block mask's item order (the caller's spec's), loaded with the
        // kernel where that is the kernel's spec too.
        let item_order = opts
            .block_mask
            .filter(|_| config.persistent() && std::ptr::eq(spec, self.called))
            .and_then(|_| Which::work_order(spec, Work::QueryTiles { block_m: config.block_m() }));
        let [loaded] = rt.load_launch(spec, [which], item_order);
        let loaded = loaded?;
        let kernel = loaded.kernel();
        let grid = launch_config(kernel, &shape, 1, rt.sm_count())?;
        // The checks put params first, so the tensors are exactly the
        // arguments with device pointers, in declaration order.
        let (tensor_ptrs, _tensors) = tensor_ptrs(self.args, stream);
        let item_order = opts.block_mask.map(|m| m.for_forward(rt, self.called, kernel, (shape, infos, &tensor_ptrs)));
        let item_order = item_order.transpose()?.flatten();
        let block_mask = opts.block_mask.map(|m| (m.classes.device_ptr(stream), m.strides));
        let item_order = item_order.as_ref().map(|order| order.device_ptr(stream));
        let work_counter = rt.work_counter_for(kernel, stream);
        let bindings = Bindings {
            ptrs: [q_ptr, k_ptr, v_ptr, o_ptr],
            strides: [q_layout.strides, k_layout.strides, v_layout.strides, o_layout.strides],
            lse: lse.as_ref().map_or(0, |(ptr, _)| *ptr),
            scale: self.scale,
            block_mask: block_mask.as_ref().map_or((0, [0; 2]), |((ptr, _), strides)| (*ptr, *strides)),
            work_order: item_order.as_ref().map_or(0, |(ptr, _)| *ptr),
            work_counter: work_counter.as_ref().map(|(ptr, _)| *ptr),
            tensor_maps,
            dropout: self.dropout,
            ..Bindings::without_operands(shape, infos, &tensor_ptrs)
        };

        // SAFETY: `launch_bound` marshals the kernel's own argument list, so
        // the values match its parameters in order and type, and `check_forward`
        // proved every element they let the kernel address is inside the
        // buffer it belongs to; a block mask was built for this very shape
        // and the mask tile every candidate configuration reads, so it holds
        // a byte for every tile the grid reads.
        unsafe { launch_bound(rt, stream, &loaded, &bindings, grid) }
    }
}

/// The TMA descriptors of Q, K, V and O (`operands`) a launch in `config`
/// copies with: a warp-specialized configuration's, where TMA is on and can
/// address every operand; else `None`, and the kernel copies with its
/// threads.
fn tensor_maps(
    rt: &Runtime,
    spec: &Spec,
    config: TileConfig,
    operands: &[(Operand, u64, &Layout); 4],
) -> Option<TensorMaps> {
    let tile = tma::Tile { block_m: config.block_m(), block_n: config.block_n };
    tma::tensor_maps(operands, tile, spec.dtype, rt.tma && config.persistent(), tma::Rows::Batched)
}
