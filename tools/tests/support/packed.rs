//! What the packed-sequence tests (varlen forward and backward, paged)
//! share: their rows' columns, their case lists over every variant and
//! over edge lengths, device prefix sums that make no sense, and the
//! buffers of launches meant to be rejected.

use super::{heads_of, spec, spec_columns};
use flashgen::codegen::Spec;
use flashgen::cudarc::driver::CudaSlice;
use flashgen::half::bf16;
use flashgen::{PackedLayout, Runtime};
use flashgen_tools::examples::SPECS;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::fmt::Debug;

/// (queries, keys) per sequence.
pub type Lens = Vec<(usize, usize)>;

/// A packed case's columns: the spec's, its heads, its sequence count,
/// its total query and key tokens and how its operands are packed.
pub fn packed_columns(spec: &Spec, heads: (usize, usize), lens: &[(usize, usize)], packing: impl Debug) -> String {
    let (total_q, total_kv) = lens.iter().fold((0, 0), |(q, k), l| (q + l.0, k + l.1));
    format!(
        "{} h={}/{} seqs={:<3} tokens={:>5}/{:<5} {:?}",
        spec_columns(spec),
        heads.0,
        heads.1,
        lens.len(),
        total_q,
        total_kv,
        packing,
    )
}

/// A case (made by `case`) of every example variant at its heads (see
/// [`heads_of`]), on lengths `lens` draws from one freshly seeded generator.
pub fn every_variant<C>(
    mut lens: impl FnMut(&mut StdRng) -> Lens,
    case: impl Fn(Spec, (usize, usize), Lens) -> C,
) -> Vec<C> {
    let mut rng = StdRng::seed_from_u64(rand::random());
    SPECS.iter().map(|(variant, _)| case(spec(variant), heads_of(variant), lens(&mut rng))).collect()
}

/// Cases (made by `case`) of edge lengths under causal, bottom-right causal
/// and document masks, 2 query heads over 1 K/V head: a single token, one
/// sequence of `long` tokens, sequences without queries or keys, and a
/// sequence of fewer keys than queries.
pub fn edge_length_cases<C>(long: usize, case: impl Fn(Spec, (usize, usize), Lens) -> C) -> Vec<C> {
    let mut cases = Vec::new();
    for variant in ["causal", "causal_bottom_right", "document"] {
        for lens in [vec![(1, 1)], vec![(long, long)], vec![(0, 0), (0, 9), (300, 0), (0, 0)], vec![(0, 5), (77, 3)]] {
            cases.push(case(spec(variant), (2, 1), lens));
        }
    }
    cases
}

/// Prefix sums (of three sequences) that are not monotone, leave the
/// buffers or overflow: the kernels must clamp them into the buffers.
pub const GARBAGE_PREFIX_SUMS: [[i32; 4]; 3] = [[7, -3, 5000, 2], [90, 0, 45, 44], [i32::MAX, i32::MIN, 1, 89]];

/// 100 tokens of 2 heads at d = 128, packed, and two zeroed bf16 buffers of
/// that layout (an input and an output) for launches meant to be rejected.
pub fn rejected_buffers(rt: &Runtime) -> (PackedLayout, CudaSlice<bf16>, CudaSlice<bf16>) {
    let layout = PackedLayout::thd(100, 2, 128);
    let zeros = || rt.stream().alloc_zeros::<bf16>(layout.as_layout().len()).unwrap();
    (layout, zeros(), zeros())
}
