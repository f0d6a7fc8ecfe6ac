//! Context parallelism's partials launches: a forward piece merged into the
//! running O and LSE ([`Runtime::merge_partial`]), a backward piece added to
//! a running dQ, dK or dV ([`Runtime::add_partial`]), and captured tensors'
//! f32 gradients summed ([`Runtime::add_f32`]). Each checks its operands
//! (`check_partials`), then queues one launch on the runtime's stream
//! without synchronizing. The kernels are `flashgen_codegen::cuda`'s
//! `emit_merge_partial`, `emit_add_partial` and `emit_add_f32`; the caller's
//! context-parallel schedule decides which pieces meet.

use crate::check::Buffer;
use crate::check_partials::{check_add, check_add_f32, check_merge, AddBuffers, LseBuffer, MergeBuffers};
use crate::element::Element;
use crate::error::Error;
use crate::kernels::Which;
use crate::layout::Layout;
use crate::marshal::{launch_config, launch_inline, marshal_into, Bindings, PartialBindings, Value, INLINE_ARGS};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use flashgen_codegen::{Shape, Spec};

/// An operand read in the storage dtype, and its layout.
type Input<'a, T> = (&'a dyn DeviceInput<T>, Layout);
/// An operand written in the storage dtype, and its layout.
type Output<'a, T> = (&'a mut dyn DeviceOutput<T>, Layout);
/// An LSE read, and the element its rows start at.
type LseIn<'a> = (&'a CudaSlice<f32>, usize);
/// An LSE written, and the element its rows start at.
type LseOut<'a> = (&'a mut CudaSlice<f32>, usize);

/// A merge's operands. O-like operands are `[batch, rows, heads, dim]`
/// (`dim`: the spec's V head dim; `Layout::offset` in elements), LSEs
/// `f32[batch, heads, rows]` contiguous from their element offsets
/// (natural log, −∞: no kept key).
pub(crate) struct MergeIo<'a, T> {
    /// The accumulator holds nothing yet: it is read as O = 0, LSE = −∞.
    pub first: bool,
    pub acc_o: (&'a mut CudaSlice<f32>, Layout),
    pub acc_lse: LseOut<'a>,
    /// One piece's O and LSE; `None`: an empty piece.
    pub piece: Option<(Input<'a, T>, LseIn<'a>)>,
    /// Where the merged O and LSE go instead of the accumulator.
    pub out: Option<(Output<'a, T>, LseOut<'a>)>,
}

/// An add's operands, `[batch, rows, heads, dim]` each (any `dim`, the
/// accumulator's).
pub(crate) struct AddIo<'a, T> {
    /// The accumulator holds nothing yet: it is read as zeros.
    pub first: bool,
    pub acc: (&'a mut CudaSlice<f32>, Layout),
    /// One piece; `None`: zeros.
    pub piece: Option<Input<'a, T>>,
    /// Where the sum goes, rounded, instead of the accumulator.
    pub out: Option<Output<'a, T>>,
}

impl Runtime {
    /// Queues the merge of `io.piece` into the accumulator: per row, the
    /// softmax over both sides' keys (O weighed by `exp(lse − merged lse)`),
    /// written to `io.out` or back into the accumulator. `T` must be the
    /// spec's dtype.
    pub(crate) fn merge_partial<T: Element>(&self, spec: &Spec, io: MergeIo<'_, T>) -> Result<(), Error> {
        let MergeIo { first, acc_o, acc_lse, piece, out } = io;
        let lse = |(buffer, offset): (&CudaSlice<f32>, usize)| LseBuffer { offset, len: buffer.len() };
        let buffers = MergeBuffers {
            acc: Buffer { layout: acc_o.1, len: acc_o.0.len() },
            acc_lse: lse((&*acc_lse.0, acc_lse.1)),
            piece: piece.as_ref().map(|((o, layout), l)| (Buffer { layout: *layout, len: o.len() }, lse((l.0, l.1)))),
            out: out.as_ref().map(|((o, layout), l)| (Buffer { layout: *layout, len: o.len() }, lse((&*l.0, l.1)))),
        };
        let Some(shape) = check_merge(spec, T::DTYPE, &buffers)? else {
            return Ok(());
        };
        // The guards order the launch after pending work on each buffer and
        // record it for later work; they must live until after it.
        let s = self.stream().as_ref();
        let (acc_ptr, _acc) = acc_o.0.device_ptr_mut(s);
        let (acc_lse_ptr, _acc_lse) = acc_lse.0.device_ptr_mut(s);
        let piece = piece.map(|((o, layout), (l, offset))| (o.device_ptr(s), l.device_ptr(s), layout, offset));
        let out = out.map(|((o, layout), (l, offset))| (o.device_ptr_mut(s), l.device_ptr_mut(s), layout, offset));
        // The piece's and the output's O and LSE addresses and O's strides
        // (null and unread without one).
        let [piece_at, out_at] = [&piece, &out].map(|side| match side {
            Some(((o, _), (l, _), layout, offset)) => ([layout.address(*o), f32_at(*l, *offset)], layout.strides),
            None => ([0; 2], [0; 3]),
        });
        let bindings = PartialBindings {
            ptrs: [f32_at(acc_ptr, acc_o.1.offset), piece_at.0[0], out_at.0[0]],
            strides: [acc_o.1.strides, piece_at.1, out_at.1],
            lse: [f32_at(acc_lse_ptr, acc_lse.1), piece_at.0[1], out_at.0[1]],
            first,
            dim: acc_o.1.dim,
        };
        self.launch_partial(spec, Which::MergePartial, shape, bindings)
    }

    /// Queues the add of `io.piece` to the accumulator, written (rounded)
    /// to `io.out` or back into the accumulator. `T` must be the spec's
    /// dtype.
    pub(crate) fn add_partial<T: Element>(&self, spec: &Spec, io: AddIo<'_, T>) -> Result<(), Error> {
        let AddIo { first, acc, piece, out } = io;
        let buffers = AddBuffers {
            acc: Buffer { layout: acc.1, len: acc.0.len() },
            piece: piece.as_ref().map(|(p, layout)| Buffer { layout: *layout, len: p.len() }),
            out: out.as_ref().map(|(o, layout)| Buffer { layout: *layout, len: o.len() }),
        };
        let Some((shape, dim)) = check_add(spec, T::DTYPE, &buffers)? else {
            return Ok(());
        };
        // The guards must live until after the launch (see `merge_partial`).
        let s = self.stream().as_ref();
        let (acc_ptr, _acc) = acc.0.device_ptr_mut(s);
        let piece = piece.map(|(p, layout)| (p.device_ptr(s), layout));
        let out = out.map(|(o, layout)| (o.device_ptr_mut(s), layout));
        let [piece_at, out_at] =
            [&piece, &out].map(|side| side.as_ref().map_or((0, [0; 3]), |((p, _), l)| (l.address(*p), l.strides)));
        let bindings = PartialBindings {
            ptrs: [f32_at(acc_ptr, acc.1.offset), piece_at.0, out_at.0],
            strides: [acc.1.strides, piece_at.1, out_at.1],
            lse: [0; 3],
            first,
            dim,
        };
        self.launch_partial(spec, Which::AddPartial, shape, bindings)
    }

    /// Queues `acc[i] = (first ? 0 : acc[i]) + piece[i]` over every element
    /// (no piece: zeros); `piece` holds as many floats as `acc`.
    pub(crate) fn add_f32(
        &self,
        spec: &Spec,
        first: bool,
        acc: &mut CudaSlice<f32>,
        piece: Option<&CudaSlice<f32>>,
    ) -> Result<(), Error> {
        let Some(shape) = check_add_f32(acc.len(), piece.map(|p| p.len()))? else {
            return Ok(());
        };
        // The guards must live until after the launch (see `merge_partial`).
        let s = self.stream().as_ref();
        let (acc_ptr, _acc) = acc.device_ptr_mut(s);
        let piece = piece.map(|p| p.device_ptr(s));
        let ptrs = [acc_ptr, piece.as_ref().map_or(0, |(p, _)| *p), 0];
        let bindings = PartialBindings { ptrs, strides: [[0; 3]; 3], lse: [0; 3], first, dim: 0 };
        self.launch_partial(spec, Which::AddF32, shape, bindings)
    }

    /// Loads `which` of `spec` and queues it over `shape` with `partials`,
    /// whose guards the caller holds until this returns.
    fn launch_partial(&self, spec: &Spec, which: Which, shape: Shape, partials: PartialBindings) -> Result<(), Error> {
        let loaded = self.load_which(spec, which)?;
        let kernel = loaded.kernel();
        let bindings = Bindings { partials: Some(partials), ..Bindings::without_operands(shape, &[], &[]) };
        let mut values = [Value::I32(0); INLINE_ARGS];
        let count = marshal_into(kernel, &bindings, &mut values)?;
        let grid = launch_config(kernel, &shape, 1, self.sm_count())?;
        let launching = |e| Error::driver(format!("launching `{}`", kernel.name), e);
        // Stream waits queued by the guards report failures here.
        self.context().check_err().map_err(launching)?;
        // SAFETY: `marshal_into` followed the kernel's own argument list, so
        // the values match its parameters in order and type; the
        // `check_partials` checks proved that every element each operand's
        // layout addresses and each LSE's rows lie inside their buffers, that
        // the operands share the accumulator's sizes (the merge's head dim
        // being the kernel's) and that the grid covers exactly those rows.
        unsafe { launch_inline(self.stream(), loaded.function(), &values[..count], grid) }.map_err(launching)
    }
}

/// The device address of f32 element `offset` of a buffer at `base`.
fn f32_at(base: u64, offset: usize) -> u64 {
    base + (offset * std::mem::size_of::<f32>()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::marshal::marshal;
    use flashgen_codegen::cuda::{emit_add_f32, emit_add_partial, emit_merge_partial};
    use flashgen_codegen::parse_one;

    /// The partials kernels take their operands, LSEs, flag and columns
    /// from the partial bindings and their rows from the shape (without
    /// the bindings they are refused); the grid covers every CTA's rows.
    #[test]
    fn partials_kernels_marshal_their_operands() {
        let spec = parse_one("G { dtype: bf16, head_dim: 192, v_head_dim: 128 }").unwrap();
        let shape = Shape { batch: 3, heads: 8, heads_kv: 8, q_len: 100, kv_len: 0 };
        let strides = [[1, 2, 3], [4, 5, 6], [7, 8, 9]];
        let partials = PartialBindings { ptrs: [10, 11, 12], strides, lse: [20, 21, 22], first: true, dim: 192 };
        let b = Bindings { partials: Some(partials), ..Bindings::without_operands(shape, &[], &[]) };
        use Value::*;
        let strides = (1..=9).map(I64);
        let merge = emit_merge_partial(&spec);
        let expected = [Ptr(10), Ptr(20), Ptr(11), Ptr(21), Ptr(12), Ptr(22), I32(1), I32(100), I32(8)].into_iter();
        assert_eq!(marshal(&merge, &b).unwrap(), expected.chain(strides.clone()).collect::<Vec<_>>());
        let add = emit_add_partial(&spec);
        let expected = [Ptr(10), Ptr(11), Ptr(12), I32(1), I32(100), I32(8), I32(192)].into_iter();
        assert_eq!(marshal(&add, &b).unwrap(), expected.chain(strides).collect::<Vec<_>>());
        let flat = emit_add_f32(&spec);
        assert_eq!(marshal(&flat, &b).unwrap(), [Ptr(10), Ptr(11), I32(1), I32(100)]);
        let bare = Bindings::without_operands(shape, &[], &[]);
        for kernel in [&merge, &add, &flat] {
            assert!(matches!(marshal(kernel, &bare), Err(Error::KernelAbi { .. })), "{}", kernel.name);
        }
        assert_eq!(launch_config(&merge, &shape, 1, 132).unwrap().grid_dim, (7, 8, 3));
        let elements = Shape { batch: 1, heads: 1, heads_kv: 1, q_len: 1025, kv_len: 0 };
        assert_eq!(launch_config(&flat, &elements, 1, 132).unwrap().grid_dim, (3, 1, 1));
    }
}
