//! The forward on e4m3 Q, K and V (Hopper's 8-bit tensor cores): operands
//! of one byte an element, each `descale · e4m3` with f32 descale factors
//! on the device ([`QkvDescale`]), O (and the LSE) as the 16-bit forward
//! writes them. Checked as [`Runtime::forward`] checks its operands
//! (lengths and strides count bytes, as elements), then the descales'
//! lengths; the launch first rewrites V into the tiles the kernel's P·V
//! reads (`cuda::emit_e4m3_v_tiles`: keys along the rows, since 8-bit
//! wgmma reads its B operand K-major only) in scratch memory, then runs the
//! warp-specialized kernel, which copies Q, K and those tiles with TMA.

use crate::args::{tensor_ptrs, ArgInfo, ArgValue};
use crate::check::{check_forward, softmax_scale, Problem};
use crate::descale::{check_descales, DescaleLen, QkvDescale};
use crate::dropout_error::DropoutError;
use crate::e4m3_error::E4m3Error;
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::ForwardOptions;
use crate::kernels::Which;
use crate::launch_checks::launch_checked;
use crate::layout::Layout;
use crate::marshal::{launch_config, marshal, Bindings};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::runtime::Runtime;
use crate::scratch;
use crate::tma::{self, TensorMaps};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use flashgen_codegen::abi::{Operand, TmaBox};
use flashgen_codegen::cuda::{e4m3_supports, e4m3_v_row, Mma, TileConfig};
use flashgen_codegen::{Shape, Spec};

/// The operands of one e4m3 forward pass: Q, K and V of one byte an element
/// (`u8`, e4m3 bits; layouts in elements, which are bytes), O and the
/// optional LSE as [`ForwardIo`](crate::ForwardIo)'s.
pub struct ForwardE4m3Io<'a, T> {
    pub q: (&'a dyn DeviceInput<u8>, Layout),
    pub k: (&'a dyn DeviceInput<u8>, Layout),
    pub v: (&'a dyn DeviceInput<u8>, Layout),
    pub o: (&'a mut dyn DeviceOutput<T>, Layout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
}

impl Runtime {
    /// The forward of `spec` on e4m3 Q, K and V with their `descale`
    /// factors, O in `T` (the spec's dtype): checks as [`Runtime::forward`]
    /// does, then the factors' lengths (`RaggedError::DescaleLen`), and
    /// queues the V-tile kernel and the forward on [`Runtime::stream`].
    /// `opts.scale` and `opts.block_mask` apply as there; `opts.config`
    /// must be one [`tile_choice::e4m3`](crate::tile_choice::e4m3) could
    /// pick; dropout is refused. Hopper only ([`E4m3Error::Arch`]); Q, K
    /// and V 16-byte aligned ([`E4m3Error::Unaligned`]).
    pub fn forward_e4m3<T: Element>(
        &self,
        spec: &Spec,
        io: ForwardE4m3Io<'_, T>,
        descale: QkvDescale<'_>,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        let target = self.target();
        if target.mma != Mma::Wgmma {
            return Err(Error::E4m3(E4m3Error::Arch { arch: self.arch() }));
        }
        if opts.dropout.is_some_and(|d| d.p > 0.0) {
            return Err(Error::Dropout(DropoutError::Unsupported { launch: "e4m3 forward" }));
        }
        let scale = softmax_scale(spec, opts.scale)?;
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let operands = [(io.q.1, io.q.0.len()), (io.k.1, io.k.0.len()), (io.v.1, io.v.0.len()), (io.o.1, io.o.0.len())];
        let problem = Problem::new(T::DTYPE, operands, io.lse.as_ref().map(|l| l.len()));
        let Some(shape) = check_e4m3_operands(spec, &problem, &infos, &descale.lens())? else {
            return Ok(());
        };
        let config = e4m3_config(self, spec, opts.config)?;
        let v_tiles = VTiles::of(spec, shape, config.block_n)?;
        let launch = E4m3Launch { spec, shape, infos: &infos, args, scale, config, v_tiles };
        launch.run(self, io, &descale, opts)
    }
}

/// The e4m3 forward's checks of its operands (`p`: Q, K and V in bytes, O
/// and the LSE in elements) as [`check_forward`] makes them, then of the
/// descale buffers' lengths against the K/V heads. Returns the shape, or
/// `None` where nothing launches.
pub(crate) fn check_e4m3_operands(
    spec: &Spec,
    p: &Problem,
    infos: &[ArgInfo],
    descales: &[(&'static str, DescaleLen)],
) -> Result<Option<Shape>, Error> {
    let Some(shape) = check_forward(spec, p, infos)? else {
        return Ok(None);
    };
    check_descales(descales, shape.heads_kv)?;
    Ok(Some(shape))
}

/// The configuration an e4m3 launch runs in: `named` where it runs the
/// spec on e4m3 operands, else the first candidate that does.
fn e4m3_config(rt: &Runtime, spec: &Spec, named: Option<TileConfig>) -> Result<TileConfig, Error> {
    let target = rt.target();
    let refused = |reason: String| Error::E4m3(E4m3Error::Config { spec: spec.name.clone(), reason });
    match named {
        Some(config) if e4m3_supports(spec, config, target) => Ok(config),
        Some(config) => Err(refused(format!("configuration {} cannot run it", crate::tuning::config_name(config)))),
        None => crate::tile_choice::e4m3(spec, target).ok_or_else(|| {
            let dims = spec.head_dims;
            refused(format!(
                "head dims {}/{} (the e4m3 kernels take QK head dims that are multiples of 32 and V head \
                 dims that are multiples of 16, up to 128)",
                dims.qk, dims.v
            ))
        }),
    }
}

/// A checked e4m3 launch.
struct E4m3Launch<'r> {
    spec: &'r Spec,
    shape: Shape,
    infos: &'r [ArgInfo],
    args: &'r [ArgValue<'r>],
    scale: f32,
    config: TileConfig,
    v_tiles: VTiles,
}

impl E4m3Launch<'_> {
    fn run<T: Element>(
        &self,
        rt: &Runtime,
        io: ForwardE4m3Io<'_, T>,
        descale: &QkvDescale<'_>,
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        let (spec, shape, block_n) = (self.spec, self.shape, self.config.block_n);
        let ForwardE4m3Io { q: (q, q_layout), k: (k, k_layout), v: (v, v_layout), o: (o, o_layout), lse } = io;
        // The guards order the launches after pending work on each buffer
        // and record them for later work; they live until after them.
        let stream = rt.stream();
        let (q_ptr, _q) = q.device_ptr(stream);
        let (k_ptr, _k) = k.device_ptr(stream);
        let (v_ptr, _v) = v.device_ptr(stream);
        check_aligned("V", v_ptr, &v_layout)?;
        let (o_ptr, _o) = o.device_ptr_mut(stream);
        let [q_ptr, k_ptr, v_ptr] =
            [(q_ptr, &q_layout), (k_ptr, &k_layout), (v_ptr, &v_layout)].map(|(ptr, layout)| layout.byte_address(ptr));
        let o_ptr = o_layout.address(o_ptr);
        let lse = lse.map(|l| l.device_ptr_mut(stream));
        let [tiles_kernel, loaded] =
            rt.load_launch(spec, [Which::E4m3VTiles(block_n), Which::ForwardE4m3(self.config)], None);
        let (tiles_kernel, loaded) = (tiles_kernel?, loaded?);

        // V's tiles, in scratch memory the stream frees after the forward.
        let v_tiles_shape = self.v_tiles;
        // SAFETY: the V-tile kernel writes every byte of every tile, zeros
        // past the keys included, before the forward reads any.
        let mut v_tiles = unsafe { scratch::uninit::<u8>(stream, v_tiles_shape.bytes)? };
        let (v_tiles_ptr, _v_tiles) = v_tiles.device_ptr_mut(stream);
        let strides = [q_layout.strides, k_layout.strides, v_layout.strides, o_layout.strides];
        let bindings = Bindings {
            ptrs: [q_ptr, k_ptr, v_ptr, o_ptr],
            strides,
            v_tiles: v_tiles_ptr,
            ..Bindings::without_operands(shape, self.infos, &[])
        };
        // Everything that can refuse the launch comes before the first kernel.
        let operands = [(Operand::Q, q_ptr, q_layout), (Operand::K, k_ptr, k_layout)];
        let maps = tensor_maps(spec, self.config, &operands, (v_tiles_ptr, shape, v_tiles_shape), (o_ptr, o_layout))?;
        let kernel = loaded.kernel();
        let (tensor_ptrs, _tensors) = tensor_ptrs(self.args, stream);
        let item_order = opts.block_mask.map(|m| m.for_forward(rt, spec, kernel, (shape, self.infos, &tensor_ptrs)));
        let item_order = item_order.transpose()?.flatten();

        // Without keys there is no tile to write (and the forward reads none).
        if v_tiles_shape.tiles > 0 {
            let values = marshal(tiles_kernel.kernel(), &bindings)?;
            let grid = launch_config(tiles_kernel.kernel(), &shape, 1, rt.sm_count())?;
            // SAFETY: the V-tile kernel's arguments follow its own list;
            // `check_forward` proved V's rows inside its buffer, and the
            // tiles' buffer holds every tile of every (batch, K/V head).
            unsafe { launch_checked(rt, stream, &tiles_kernel, &values, grid)? };
        }

        let block_mask = opts.block_mask.map(|m| (m.classes.device_ptr(stream), m.strides));
        let item_order = item_order.as_ref().map(|order| order.device_ptr(stream));
        let work_counter = rt.work_counter_for(kernel, stream);
        let bound = descale.bind(stream);
        let values = marshal(
            kernel,
            &Bindings {
                lse: lse.as_ref().map_or(0, |(ptr, _)| *ptr),
                scale: self.scale,
                block_mask: block_mask.as_ref().map_or((0, [0; 2]), |((ptr, _), strides)| (*ptr, *strides)),
                work_order: item_order.as_ref().map_or(0, |(ptr, _)| *ptr),
                work_counter: work_counter.as_ref().map(|(ptr, _)| *ptr),
                tensor_maps: Some(maps),
                descales: Some(bound.each_ref().map(|b| b.binding)),
                ..Bindings { tensors: &tensor_ptrs, ..bindings }
            },
        )?;
        let grid = launch_config(kernel, &shape, 1, rt.sm_count())?;
        // SAFETY: `marshal` followed the kernel's own argument list;
        // `check_forward` proved every row the descriptors address inside
        // its buffer, the V-tile kernel wrote every tile they address, and
        // the descale buffers hold what their granularity reads.
        unsafe { launch_checked(rt, stream, &loaded, &values, grid) }
    }
}

/// Refuses an operand the V-tile kernel's 16-byte loads cannot read (its
/// rows' address and strides are not 16-byte multiples; an axis of one
/// element is only read at index 0, so its stride is free).
pub(crate) fn check_aligned(operand: &'static str, base: u64, layout: &Layout) -> Result<(), Error> {
    let sizes = [layout.batch, layout.seq, layout.heads];
    let strides_aligned = layout.strides.iter().zip(sizes).all(|(s, n)| n <= 1 || s % 16 == 0);
    // Modulo 2^64, which keeps the address's residue mod 16: a drawn
    // offset past a real buffer's end cannot panic here.
    let aligned = base.wrapping_add(layout.offset as u64).is_multiple_of(16) && strides_aligned;
    aligned.then_some(()).ok_or(Error::E4m3(E4m3Error::Unaligned { operand }))
}

/// One (batch, K/V head)'s V tiles: `tiles` blocks of `dvp` rows of
/// `row` bytes; `bytes` those of every (batch, K/V head).
#[derive(Clone, Copy, Debug)]
pub(crate) struct VTiles {
    pub dvp: usize,
    pub tiles: usize,
    pub row: usize,
    pub bytes: usize,
}

impl VTiles {
    /// The V tiles of a checked launch of `spec` at `shape` in tiles of
    /// `block_n` keys. Refuses tiles of more bytes than the V-tile kernel's
    /// 64-bit offsets hold (V, Q and O broadcast with zero strides pass
    /// the operands' checks at any batch and head count).
    pub(crate) fn of(spec: &Spec, shape: Shape, block_n: u32) -> Result<VTiles, Error> {
        let dvp = spec.head_dims.v.next_multiple_of(16) as usize;
        let (tiles, row) = (shape.kv_len.div_ceil(block_n as usize), e4m3_v_row(block_n) as usize);
        let bytes = [shape.heads_kv, tiles, dvp, row].iter().try_fold(shape.batch, |n, &m| n.checked_mul(m));
        let max = i64::MAX as usize;
        match bytes.filter(|&b| b <= max) {
            Some(bytes) => Ok(VTiles { dvp, tiles, row, bytes }),
            None => Err(Error::TooLarge { what: "the e4m3 V tiles' bytes", value: bytes.unwrap_or(usize::MAX), max }),
        }
    }
}

/// The TMA descriptors of an e4m3 launch: Q and K (`operands`) as 16-bit
/// elements of half the columns, V's tiles (at `v_tiles.0`, `[batch,
/// heads_kv, tiles · dvp rows, row / 2]` 16-bit elements) in boxes of one
/// 128-byte panel of a tile's rows, O as the 16-bit forward's.
fn tensor_maps(
    spec: &Spec,
    config: TileConfig,
    [q, k]: &[(Operand, u64, Layout); 2],
    (v_tiles, shape, v): (u64, Shape, VTiles),
    (o_ptr, o_layout): (u64, Layout),
) -> Result<TensorMaps, Error> {
    let tile = |op| TmaBox::of(op, config.block_m(), config.block_n);
    let halves = |&(op, ptr, layout): &(Operand, u64, Layout), name| {
        let unaligned = Error::E4m3(E4m3Error::Unaligned { operand: name });
        // Byte strides as 16-bit ones: odd ones cannot be 16-byte multiples
        // (an axis of one element is only read at index 0: any stride does).
        let sizes = [layout.batch, layout.seq, layout.heads];
        if layout.strides.iter().zip(sizes).any(|(s, n)| n > 1 && s % 2 != 0) {
            return Err(unaligned);
        }
        let halves = Layout { dim: layout.dim / 2, strides: layout.strides.map(|s| s / 2), offset: 0, ..layout };
        Ok((op, tma::encode(ptr, &halves, spec.dtype, tile(op)).ok_or(unaligned)?))
    };
    let (rows, row) = ((v.tiles * v.dvp) as i64, (v.row / 2) as i64);
    let v_layout = Layout {
        batch: shape.batch,
        seq: v.tiles * v.dvp,
        heads: shape.heads_kv,
        dim: v.row / 2,
        strides: [shape.heads_kv as i64 * rows * row, row, rows * row],
        offset: 0,
    };
    let v_box = TmaBox { cols: TmaBox::COLS, rows: v.dvp as u32 };
    let unaligned = |operand| Error::E4m3(E4m3Error::Unaligned { operand });
    let v = tma::encode(v_tiles, &v_layout, spec.dtype, v_box).ok_or(unaligned("V"))?;
    let o = tma::encode(o_ptr, &o_layout, spec.dtype, tile(Operand::O)).ok_or(unaligned("O"))?;
    Ok([halves(q, "Q")?, halves(k, "K")?, (Operand::V, v), (Operand::O, o)].into_iter().collect())
}
