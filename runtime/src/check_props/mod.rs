//! Randomized property tests of the launch checks (`check*.rs`). On drawn
//! shapes, layouts (the constructors' and wild strides and offsets) and
//! buffer lengths, each check family must:
//!
//! 1. never panic (the tests also run in debug builds, where overflowing
//!    arithmetic panics);
//! 2. when it accepts, hand the kernel only elements inside its buffers:
//!    the least and greatest element offset of every operand, computed here
//!    independently in i128 ([`span`]), lie in `0..len`, and so do the
//!    LSEs', prefix sums', tables' and lengths' entries the kernel reads;
//! 3. accept well-formed launches (the constructors' layouts, exact lengths,
//!    sizes within the documented limits), so that rejecting everything
//!    cannot pass, and refuse them once a buffer is one element short.
//!
//! Draws are deterministic (fixed seeds, [`Rng`]); a failure names the case
//! and prints its input.

mod block_mask;
mod decode;
mod dense;
mod e4m3;
mod partials;
mod ragged;

use crate::args::ArgInfo;
use crate::layout::{Layout, PackedLayout};
use flashgen_codegen::{parse_one, Dtype, Shape, Spec};
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Cases per property: a few seconds for all of them in a debug build.
const CASES: u64 = 3000;

/// SplitMix64 (small, deterministic and the same on every platform), and
/// how often the current case draws odd values (`heat`, in percent: a case
/// of many rare faults is rejected by the first, so the faults' rate varies
/// from case to case).
pub(super) struct Rng {
    state: u64,
    heat: usize,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed, heat: 100 }
    }

    /// Starts a case: odd values at a fifth, half or all of their rate.
    pub fn case(&mut self) -> &mut Rng {
        self.heat = self.pick(&[20, 50, 100]);
        self
    }

    pub fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (self.state ^ (self.state >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    /// An odd value's chance: `percent` at the case's heat.
    pub fn odd(&mut self, percent: usize) -> bool {
        self.below(100 * 100) < percent * self.heat
    }

    pub fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }

    /// A size: mostly `0..=small`, at times one past a check's limit (grid,
    /// i32) or one whose products overflow.
    pub fn size(&mut self, small: usize) -> usize {
        match self.odd(6) {
            true => self.pick(&EDGES),
            false => self.below(small + 1),
        }
    }

    /// A head count and a K/V head count: mostly a divisor of it, at times
    /// zero, not a divisor, or an edge.
    pub fn heads(&mut self) -> (usize, usize) {
        let heads = match self.odd(5) {
            true => self.pick(&EDGES),
            false => self.pick(&[0, 1, 2, 3, 4, 6, 8, 12]),
        };
        let heads_kv = match (self.odd(10), self.chance(50)) {
            (true, true) => self.pick(&[0, 3, 5, heads.wrapping_add(1)]),
            (true, false) => self.pick(&EDGES),
            _ => self.pick(&[1, 2, 3, 4, 6]).min(heads.max(1)),
        };
        (heads, if heads_kv > 0 && heads % heads_kv != 0 && self.chance(70) { 1 } else { heads_kv })
    }

    /// `dim`, or at times another head dim.
    pub fn dim(&mut self, dim: u32) -> usize {
        match self.odd(4) {
            true => self.pick(&[0, 1, dim as usize + 8, usize::MAX]),
            false => dim as usize,
        }
    }

    /// A layout of these sizes from a constructor: BSHD, BHSD, a view into
    /// a fused QKV projection (as its Q, K or V), or BSHD with padded rows,
    /// at times at an offset.
    pub fn layout(&mut self, [batch, seq, heads, dim]: [usize; 4]) -> Layout {
        let other = self.pick(&[1, 2, 8]);
        let l = match self.below(5) {
            0 => Layout::bshd(batch, seq, heads, dim),
            1 => Layout::bhsd(batch, seq, heads, dim),
            2 => Layout::fused_qkv(batch, seq, heads, other, dim)[0],
            3 => Layout::fused_qkv(batch, seq, other, heads, dim)[1 + self.below(2)],
            _ => {
                let l = Layout::bshd(batch, seq, heads, dim);
                let row = l.strides[1].saturating_add(self.below(64) as i64);
                let batch_stride = row.saturating_mul(seq as i64).saturating_add(self.below(3) as i64);
                Layout { strides: [batch_stride, row, l.strides[2]], ..l }
            }
        };
        match self.chance(25) {
            true => l.at(self.below(300)),
            false => l,
        }
    }

    /// A packed `[tokens, heads, dim]` operand as the checks see it: THD,
    /// head-major, padded rows or a fused QKV view, at times at an offset.
    pub fn packed(&mut self, [tokens, heads, dim]: [usize; 3]) -> Layout {
        let thd = PackedLayout::thd(tokens, heads, dim);
        let wide = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let strides = match self.below(4) {
            0 => thd.strides,
            1 => [wide(dim), wide(tokens.saturating_mul(dim))],
            2 => [thd.strides[0].saturating_add(self.below(64) as i64), wide(dim)],
            _ => [wide(heads.saturating_add(self.pick(&[2, 4, 16])).saturating_mul(dim)), wide(dim)],
        };
        let offset = if self.chance(25) { self.below(300) } else { 0 };
        PackedLayout { strides, offset, ..thd }.as_layout()
    }

    /// `l`, or at times `l` with one stride or its offset replaced by a wild
    /// value: negative, zero, off by one, huge, near `i64::MAX` / `usize::MAX`.
    pub fn wild(&mut self, mut l: Layout) -> Layout {
        if self.odd(20) {
            let axis = self.below(3);
            let s = l.strides[axis];
            let wild = [0, -1, s.wrapping_neg(), s.saturating_add(1), s.saturating_sub(1), s.saturating_mul(3)];
            let huge = [i64::MAX, i64::MAX - 1, i64::MIN, 1 << 40, 1 << 62, self.next() as i64];
            l.strides[axis] = if self.chance(50) { self.pick(&wild) } else { self.pick(&huge) };
        }
        if self.odd(10) {
            l.offset = self.pick(&[1, 1 << 40, i64::MAX as usize, 1 << 63, usize::MAX - 1, usize::MAX]);
        }
        l
    }

    /// A buffer length for an operand that needs `need` elements: mostly
    /// exact, else one short, one or many more, none or huge.
    pub fn len(&mut self, need: usize) -> usize {
        if !self.odd(35) {
            return need;
        }
        match self.below(4) {
            0 => need.saturating_sub(1),
            1 => need.saturating_add(1 + self.below(1000)),
            2 => self.pick(&[0, 1, i64::MAX as usize, usize::MAX]),
            _ => self.next() as usize,
        }
    }

    /// An optional length (an LSE's, a table's) around `need`.
    pub fn opt_len(&mut self, need: usize) -> Option<usize> {
        match self.chance(15) {
            true => None,
            false => Some(self.len(need)),
        }
    }

    /// An entry count the kernel reads `need` of: mostly exact, else off by one.
    pub fn count(&mut self, need: usize) -> usize {
        match self.odd(35) {
            true => self.pick(&[need.saturating_sub(1), need.saturating_add(1), 0, usize::MAX]),
            false => need,
        }
    }
}

/// Sizes around the checks' limits and past any buffer.
const EDGES: [usize; 9] =
    [65_535, 65_536, i32::MAX as usize, 1 << 31, 1 << 32, 1 << 40, usize::MAX / 2, usize::MAX - 1, usize::MAX];

/// The least and greatest element offsets `l` addresses, or `None` where it
/// addresses none, computed independently of `check::needed_len`: in i128,
/// saturating (a saturated bound is outside every buffer), negative strides
/// lowering the least.
pub(super) fn span(l: &Layout) -> Option<(i128, i128)> {
    let sizes = [l.batch, l.seq, l.heads, l.dim];
    if sizes.contains(&0) {
        return None;
    }
    let (mut lo, mut hi) = (l.offset as i128, l.offset as i128 + (l.dim as i128 - 1));
    for (&size, stride) in sizes.iter().zip(l.strides) {
        let step = (size as i128 - 1).saturating_mul(stride as i128);
        match step < 0 {
            true => lo = lo.saturating_add(step),
            false => hi = hi.saturating_add(step),
        }
    }
    Some((lo, hi))
}

/// The elements a buffer holding `l` exactly has: its last element's offset
/// + 1, or, where `l` addresses none, its offset (where it starts).
pub(super) fn need(l: &Layout) -> usize {
    match span(l) {
        Some((_, hi)) => usize::try_from(hi.saturating_add(1)).unwrap_or(usize::MAX),
        None => l.offset,
    }
}

/// What an accepted check hands the kernel for `l` in a buffer of `len`:
/// every element it addresses inside the buffer, at an offset the kernel's
/// i64 indexing holds; and, where it launches, its first element's address
/// (`Layout::address`) at most one past the buffer's end, even where it
/// addresses no element.
pub(super) fn assert_inside(what: &str, l: &Layout, len: usize, launched: bool, case: &dyn Debug) {
    if let Some((lo, hi)) = span(l) {
        let ok = lo >= 0 && hi < len as i128 && hi <= i64::MAX as i128;
        assert!(ok, "{what}: accepted element offsets {lo}..={hi} in a buffer of {len}: {case:?}");
    }
    let start = !launched || l.offset <= len;
    assert!(start, "{what}: accepted a start at {} past a buffer of {len}: {case:?}", l.offset);
}

/// An accepted launch's entry count `len` (an LSE, prefix sums, a table)
/// holds the `need` (computed in u128) that the kernel reads.
pub(super) fn assert_holds(what: &str, len: usize, need: u128, case: &dyn Debug) {
    assert!(len as u128 >= need, "{what}: accepted {len} entries where the kernel reads {need}: {case:?}");
}

/// `spec`'s QK and V head dims, or (`wild`) dims drawn around them.
pub(super) fn head_dims(rng: &mut Rng, spec: &Spec, wild: bool) -> [usize; 2] {
    [spec.head_dims.qk, spec.head_dims.v].map(|d| if wild { rng.dim(d) } else { d as usize })
}

/// Runs `check` on [`CASES`] wild draws (`draw` of each case's generator)
/// and `sound` on what it accepts; a panic in the check fails the test,
/// naming the draw, and so does accepting no more than one draw in
/// `share` (a check that refuses everything proves nothing). Returns the
/// generator, for a test's well-formed draws after.
pub(super) fn wild<D: Debug, T, E>(
    seed: u64,
    share: u64,
    draw: impl Fn(&mut Rng) -> D,
    check: impl Fn(&D) -> Result<T, E>,
    sound: impl Fn(&D, T),
) -> Rng {
    let (mut rng, mut accepted) = (Rng::new(seed), 0);
    for _ in 0..CASES {
        let d = draw(rng.case());
        if let Ok(launch) = no_panic(&d, || check(&d)) {
            sound(&d, launch);
            accepted += 1;
        }
    }
    assert!(accepted > CASES / share, "only {accepted} of {CASES} wild draws accepted");
    rng
}

/// `check()`, failing the test with the case's input where it panics.
pub(super) fn no_panic<R>(case: &dyn Debug, check: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(check)).unwrap_or_else(|_| panic!("the check panicked on {case:?}"))
}

/// The specs drawn from: equal and unequal head dims, f16 and bf16, and one
/// tensor sized by the batch and the key length.
pub(super) fn specs() -> [Spec; 3] {
    [
        "P { dtype: bf16, head_dim: 64 }",
        "G { dtype: f16, head_dim: 192, v_head_dim: 128 }",
        "T { dtype: bf16, head_dim: 128, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
    ]
    .map(|s| parse_one(s).unwrap())
}

/// The launch's dtype: mostly the spec's.
pub(super) fn dtype(rng: &mut Rng, spec: &Spec) -> Dtype {
    match rng.odd(4) {
        true => [Dtype::F16, Dtype::Bf16].into_iter().find(|&d| d != spec.dtype).unwrap(),
        false => spec.dtype,
    }
}

/// Args for `spec`'s tensors at `shape`: exact, or each one short.
pub(super) fn args(spec: &Spec, shape: &Shape, short: bool) -> Vec<ArgInfo> {
    let len = |n: usize| if short { n.saturating_sub(1) } else { n };
    spec.tensors.iter().map(|t| ArgInfo::Tensor(t.elem, len(t.len(shape)))).collect()
}

/// The longest sequence or packed batch a launch takes (`check::MAX_LEN`).
pub(super) const LEN: u128 = crate::check::MAX_LEN as u128;

/// The sizes the launches' grids and i32 arguments hold (`check_shape`).
pub(super) fn within_limits(shape: &Shape) -> bool {
    let len = crate::check::MAX_LEN;
    shape.batch <= 65_535 && shape.heads <= 65_535 && shape.q_len <= len && shape.kv_len <= len
}

#[test]
fn the_model_spans_constructor_layouts_exactly() {
    // A sanity check of the model itself against the layouts' own lengths.
    let l = Layout::bshd(2, 5, 3, 64);
    assert_eq!(span(&l), Some((0, 2 * 5 * 3 * 64 - 1)));
    assert_eq!(span(&Layout::bhsd(2, 5, 3, 64).at(7)), Some((7, 7 + 2 * 5 * 3 * 64 - 1)));
    let [q, k, v] = Layout::fused_qkv(2, 5, 8, 2, 64);
    assert_eq!(need(&q).max(need(&k)).max(need(&v)), 2 * 5 * 12 * 64);
    assert_eq!(span(&Layout { strides: [-10, 64, 1], ..Layout::bshd(3, 1, 1, 1) }), Some((-20, 0)));
    assert_eq!(need(&Layout::bshd(0, 5, 3, 64).at(9)), 9);
}
