//! GPU correctness of the generated backward kernels: dQ, dK, dV and tensor
//! gradients judged with FlashAttention's rule (factor 3) against the f64
//! reference backward, the baseline's error being its mean over 16
//! same-dtype emulations that round on shifted grids
//! ([`verify::check_backward`]). One emulation is too noisy a yardstick for
//! ALiBi's slopes gradient (one f32 per head, a sum that nearly cancels):
//! its error was sometimes accidentally tiny, and a correct kernel failed
//! about one run in two (issue 5; see bench/RESULTS.md).
//!
//! Each case runs the GPU forward (O, LSE) and then the backward on fresh
//! random inputs with NaN-poisoned outputs (the seed is printed with every
//! row). The CPU references of all cases are computed in parallel after the
//! GPU runs. Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU fails them.

mod support;

use flashgen::codegen::cuda::{BackwardConfig, BackwardTile, KeyColumns, Mma};
use flashgen::codegen::{Dtype, Shape, Spec};
use flashgen::runtime::KernelSet;
use flashgen::{BackwardWorkspace, Error, Runtime};
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::{self, DeviceProblem, GpuGradients, OperandLayout};
use support::backward::{same_on_a_second_run, GpuRuns};
use support::{language_spec, params, runtime, spec, with};

#[derive(Clone, Copy)]
struct Case {
    batch: usize,
    heads: (usize, usize),
    seqs: (usize, usize),
    deterministic: bool,
    block_mask: bool,
    /// Whether the run asks for the trainable tensors' gradients.
    tensor_grads: bool,
    /// The dK/dV tile (`None`: the runtime's choice).
    tile: Option<BackwardTile>,
}

impl Case {
    fn new(heads: (usize, usize), seqs: (usize, usize)) -> Self {
        Case { batch: 2, heads, seqs, deterministic: false, block_mask: false, tensor_grads: true, tile: None }
    }

    fn deterministic(self) -> Self {
        Case { deterministic: true, ..self }
    }
}

/// Runs every (spec, case) on the GPU, then checks them all against the
/// reference in parallel; prints a table and fails if any row failed. The
/// checked runs share one workspace, reused and grown across cases (a stale
/// dQ accumulator would fail the check); the deterministic mode's second run
/// allocates its own and must match bit for bit.
fn run_all(rt: &Runtime, cases: Vec<(Spec, Case)>) {
    let mut runs = GpuRuns::new();
    let workspace = BackwardWorkspace::default();
    for (spec, case) in cases {
        let shape = Shape {
            batch: case.batch,
            heads: case.heads.0,
            heads_kv: case.heads.1,
            q_len: case.seqs.0,
            kv_len: case.seqs.1,
        };
        let seed: u64 = rand::random();
        let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, seed);
        let d_out = verify::random_d_out(&spec, shape, seed);
        let row = format!(
            "{:<22} {:?} d={}/{} h={}/{} s={}/{} {}{}{}{} seed {seed}",
            spec.name,
            spec.dtype,
            spec.head_dims.qk,
            spec.head_dims.v,
            case.heads.0,
            case.heads.1,
            case.seqs.0,
            case.seqs.1,
            if case.deterministic { "deterministic" } else { "atomic" },
            if case.block_mask { " block-mask" } else { "" },
            if case.tensor_grads { "" } else { " no-tensor-grads" },
            case.tile.map_or(String::new(), |tile| format!(" [{tile}]")),
        );
        let gpu = (|| -> Result<GpuGradients, Error> {
            let mut gpu = DeviceProblem::upload(rt, &spec, &problem, OperandLayout::Bshd)?;
            if case.block_mask {
                gpu.build_block_mask(rt, &spec, &problem)?;
            }
            gpu.launch(rt, &spec, &problem)?;
            gpu.pin_backward_tile(case.tile);
            let grads =
                gpu.backward(rt, &spec, &problem, &d_out, case.deterministic, case.tensor_grads, Some(&workspace))?;
            if case.deterministic {
                let again = gpu.backward(rt, &spec, &problem, &d_out, true, case.tensor_grads, None)?;
                same_on_a_second_run(&spec, &grads, &again)?;
            }
            Ok(grads)
        })();
        runs.record(row, gpu, |grads| (spec, problem, d_out, grads));
    }
    runs.judge(|(spec, problem, d_out, grads)| {
        verify::check_backward(spec, problem, d_out, grads).map_err(|e| e.to_string())
    });
}

/// Every example variant (trainable tensors included: ALiBi slopes, the
/// relative bias) at awkward sequence lengths, MHA and GQA.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_at_awkward_seqlens() {
    let rt = runtime();
    let mut cases = Vec::new();
    for (variant, _) in SPECS {
        for seqs in [(113, 203), (128, 217)] {
            let heads = if variant == "gqa" { (4, 2) } else { (3, 3) };
            cases.push((spec(variant), Case::new(heads, seqs)));
        }
    }
    for variant in ["causal", "document", "alibi", "gqa"] {
        cases.push((spec(variant), Case { batch: 1, ..Case::new((2, 1), (1024, 1023)) }));
    }
    // Trainable tensors whose gradients nobody asks for: a dK/dV kernel
    // without their terms.
    for variant in ["alibi", "relative_bias"] {
        cases.push((spec(variant), Case { tensor_grads: false, ..Case::new((3, 3), (113, 203)) }));
        cases.push((spec(variant), Case { tensor_grads: false, ..Case::new((2, 1), (1024, 1023)) }.deterministic()));
    }
    run_all(&rt, cases);
}

/// The i32 operators, Euclidean builtins and dimension expressions
/// (`language.attn`): in the mask, the score and the index of a trainable
/// tensor sized by an expression.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn language_features() {
    let rt = runtime();
    let spec = language_spec();
    let cases = vec![
        (spec.clone(), Case::new((4, 4), (113, 203))),
        (spec.clone(), Case { block_mask: true, ..Case::new((4, 2), (1024, 1023)) }),
        (spec, Case::new((2, 1), (300, 555)).deterministic()),
    ];
    run_all(&rt, cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn deterministic_mode_is_exact_and_reproducible() {
    let rt = runtime();
    let mut cases = Vec::new();
    for variant in ["full", "causal", "sliding_window", "document", "alibi", "softcap", "relative_bias", "gqa"] {
        let heads = if variant == "gqa" { (4, 2) } else { (2, 2) };
        cases.push((spec(variant), Case::new(heads, (113, 203)).deterministic()));
    }
    cases.push((spec("causal"), Case { batch: 1, ..Case::new((2, 1), (1024, 1023)) }.deterministic()));
    run_all(&rt, cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn head_dims_dtypes_and_head_groups() {
    let rt = runtime();
    let mut cases = Vec::new();
    for variant in ["causal", "softcap"] {
        for dtype in [Dtype::F16, Dtype::Bf16] {
            for (qk, v) in [
                (64, 64),
                (128, 128),
                (59, 59),
                (96, 96),
                (120, 120),
                (113, 128),
                (160, 160),
                (192, 192),
                (192, 128),
                (256, 256),
            ] {
                cases.push((with(spec(variant), dtype, qk, v), Case::new((4, 2), (113, 203))));
            }
        }
    }
    // Head dims above 128: per-head and per-pair tensor gradients, a
    // data-dependent mask and the deterministic dQ kernel, where two warps
    // share 16 keys, each with its part of dK's and dV's columns (224, 256;
    // one part alone adds the tensors' gradients), and where one warp holds
    // them all (160/128).
    for variant in ["alibi", "relative_bias", "document"] {
        for (qk, v) in [(224, 224), (256, 256), (160, 128)] {
            cases.push((with(spec(variant), Dtype::Bf16, qk, v), Case::new((4, 2), (113, 203))));
        }
    }
    cases.push((with(spec("alibi"), Dtype::F16, 256, 256), Case::new((4, 2), (300, 555)).deterministic()));
    for heads in [(6, 6), (6, 2), (6, 1)] {
        cases.push((spec("alibi"), Case::new(heads, (128, 217))));
        cases.push((with(spec("causal"), Dtype::Bf16, 64, 64), Case::new(heads, (128, 217)).deterministic()));
    }
    run_all(&rt, cases);
}

/// Every dK/dV tile a launch may choose (`BackwardConfig::tiles`) computes
/// the gradients: both kernels at d = 128 on Hopper, one warp or column
/// halves, 2 to 8 warps, 16- to 64-query steps, with tensor gradients
/// (ALiBi's slopes) and under a data-dependent mask.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_backward_tile() {
    let rt = runtime();
    let mut cases = Vec::new();
    for (variant, qk, v) in
        [("alibi", 64, 64), ("alibi", 128, 128), ("alibi", 160, 160), ("document", 192, 128), ("alibi", 256, 256)]
    {
        let spec = with(spec(variant), Dtype::Bf16, qk, v);
        for tile in BackwardConfig::tiles(&spec, rt.target()) {
            cases.push((spec.clone(), Case { tile: Some(tile), ..Case::new((4, 2), (113, 203)) }));
        }
    }
    run_all(&rt, cases);
}

/// The Hopper dK/dV kernel with column halves (both warpgroups on 64 keys),
/// pinned: sequences long enough for 256's one-stage ring and single dQ
/// tile to wrap many times and 192/128's two stages, both halves' chunk
/// kinds (192's start inside a panel), head dims padded to whole panels
/// (160, 224/200, 176/128), tensor gradients only one warpgroup adds
/// (ALiBi), a score mod's derivative (softcap), a block mask, f16, the
/// deterministic mode and copies without TMA. Vacuous off Hopper.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn hopper_column_halves() {
    run_pinned(
        KeyColumns::Halves,
        &[
            ("causal", Dtype::Bf16, 256, 256),
            ("alibi", Dtype::Bf16, 192, 128),
            ("softcap", Dtype::Bf16, 256, 256),
            ("document", Dtype::F16, 256, 128),
            ("full", Dtype::Bf16, 192, 192),
            // Head dims padded to whole panels: zero columns past D.
            ("causal", Dtype::Bf16, 160, 160),
            ("softcap", Dtype::Bf16, 224, 200),
            ("document", Dtype::Bf16, 176, 128),
        ],
    );
}

/// The Hopper dK/dV kernel in transposed tiles (each warpgroup 48 keys, 32
/// above 192, dK and dV with head dims as rows), pinned: 192/128's two
/// stages and 192's and 256's one wrapping many times, dQ in two chunks
/// (192) and one (128/192, 64/160, 256), head dims padded to whole panels
/// (160, 176/128, 144, 224/200), tensor
/// gradients (ALiBi), a score mod's derivative (softcap), a block mask,
/// f16, the deterministic mode and copies without TMA. Vacuous off Hopper.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn hopper_transposed_tiles() {
    run_pinned(
        KeyColumns::Transposed,
        &[
            ("causal", Dtype::Bf16, 192, 128),
            ("alibi", Dtype::Bf16, 192, 192),
            ("softcap", Dtype::Bf16, 192, 192),
            ("document", Dtype::F16, 192, 128),
            ("full", Dtype::Bf16, 128, 192),
            ("causal", Dtype::Bf16, 160, 160),
            ("softcap", Dtype::Bf16, 176, 128),
            ("alibi", Dtype::F16, 144, 144),
            ("full", Dtype::Bf16, 64, 160),
            // 32 keys per warpgroup above 192.
            ("causal", Dtype::Bf16, 256, 256),
            ("softcap", Dtype::Bf16, 224, 200),
            ("document", Dtype::F16, 256, 128),
        ],
    );
}

/// Each spec `(variant, dtype, qk, v)` on its Hopper tile with `columns`:
/// a long sequence (causal and ALiBi), awkward lengths (under a block mask
/// for documents), the deterministic mode and copies without TMA.
fn run_pinned(columns: KeyColumns, specs: &[(&str, Dtype, u32, u32)]) {
    let rt = runtime();
    let pinned = |spec: &Spec| {
        let tile =
            BackwardConfig::tiles(spec, rt.target()).into_iter().find(|t| t.mma == Mma::Wgmma && t.columns == columns);
        assert!(tile.is_some() || rt.target().mma != Mma::Wgmma, "{} has a Hopper tile {columns:?}", spec.name);
        tile
    };
    let long = |tile| Case { batch: 1, tile: Some(tile), ..Case::new((2, 1), (1024, 1023)) };
    let short = |tile| Case { tile: Some(tile), ..Case::new((4, 2), (113, 203)) };
    let mut cases = Vec::new();
    let mut copies = Vec::new();
    for &(variant, dtype, qk, v) in specs {
        let spec = with(spec(variant), dtype, qk, v);
        let Some(tile) = pinned(&spec) else { continue };
        if matches!(variant, "causal" | "alibi") {
            cases.push((spec.clone(), long(tile)));
        }
        cases.push((spec.clone(), Case { block_mask: variant == "document", ..short(tile) }));
        cases.push((spec.clone(), short(tile).deterministic()));
        copies.push((spec, short(tile)));
    }
    run_all(&rt, cases);
    run_all(&rt.with_tma(false), copies);
}

/// The Hopper dK/dV kernel in 128-query steps (d = 64, dQ split by rows),
/// pinned: a long causal sequence whose last step's second dQ tile lies
/// past the queries, awkward lengths, full attention, a window, a block
/// mask, f16, the deterministic mode and copies without TMA. Vacuous off
/// Hopper.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn hopper_long_query_steps() {
    run_steps_of(
        128,
        &[
            ("causal", Dtype::Bf16, 64),
            ("full", Dtype::Bf16, 64),
            ("sliding_window", Dtype::Bf16, 64),
            ("document", Dtype::F16, 64),
        ],
        &[((2, 1), (1000, 1023))],
    );
}

/// The Hopper dK/dV kernel in 80-query steps (d = 128, dQ transposed into
/// 16-query groups of the accumulator, dS from P's fragments), pinned: long
/// sequences whose steps start inside the accumulator's tiles and whose
/// last step ends past the queries, awkward lengths, full attention, a
/// window, a block mask, a head dim padded to 128 (120), f16, the
/// deterministic mode and copies without TMA. Vacuous off Hopper.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn hopper_transposed_dq_steps() {
    run_steps_of(
        80,
        &[
            ("causal", Dtype::Bf16, 128),
            ("full", Dtype::Bf16, 128),
            ("sliding_window", Dtype::Bf16, 128),
            ("document", Dtype::F16, 128),
            ("causal", Dtype::Bf16, 120),
        ],
        &[((2, 1), (1000, 1023)), ((2, 2), (1030, 777))],
    );
}

/// A long run's query and K/V heads, and query and key lengths.
type LongCase = ((usize, usize), (usize, usize));

/// Each spec `(variant, dtype, d)` on its Hopper tile of `block_m`-query
/// steps: one batch row per long case `(heads, seqs)`, awkward lengths
/// (under a block mask for documents), the deterministic mode and copies
/// without TMA.
fn run_steps_of(block_m: u32, specs: &[(&str, Dtype, u32)], long: &[LongCase]) {
    let rt = runtime();
    let pinned = |spec: &Spec| {
        let tiles = BackwardConfig::tiles(spec, rt.target());
        let tile = tiles.into_iter().find(|t| t.mma == Mma::Wgmma && t.block_m == block_m);
        assert!(
            tile.is_some() || rt.target().mma != Mma::Wgmma,
            "{} has a Hopper tile of {block_m}-query steps",
            spec.name
        );
        tile
    };
    let mut cases = Vec::new();
    let mut copies = Vec::new();
    for &(variant, dtype, d) in specs {
        let spec = with(spec(variant), dtype, d, d);
        let Some(tile) = pinned(&spec) else { continue };
        let short = Case { tile: Some(tile), block_mask: variant == "document", ..Case::new((4, 2), (113, 203)) };
        for &(heads, seqs) in long {
            cases.push((spec.clone(), Case { batch: 1, tile: Some(tile), ..Case::new(heads, seqs) }));
        }
        cases.push((spec.clone(), short));
        cases.push((spec.clone(), short.deterministic()));
        copies.push((spec, short));
    }
    run_all(&rt, cases);
    run_all(&rt.with_tma(false), copies);
}

/// `Runtime::prepare` compiles a spec's training kernels up front: a
/// training step under a block mask (its build, the forward with its item
/// order, the backward with its key order; causal attention's in short
/// keys' 64-query steps) then loads every kernel from memory, and is still
/// right.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_prepared_training_step_compiles_nothing() {
    let rt = runtime();
    for variant in ["document", "alibi", "causal"] {
        let spec = spec(variant);
        rt.prepare(&spec, KernelSet::Training).unwrap_or_else(|e| panic!("{variant}: {e}"));
        let prepared = rt.cache_stats();
        let case = Case { block_mask: true, ..Case::new((2, 2), (1024, 1023)) };
        run_all(&rt, vec![(spec, case)]);
        let after = rt.cache_stats();
        assert_eq!((after.compiles, after.disk_hits), (prepared.compiles, prepared.disk_hits), "{variant}");
    }
}

/// The Hopper dK/dV kernel's producer copying with cp.async, as on layouts
/// TMA cannot address (elsewhere the tests run it with TMA where it can).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn without_tma() {
    let rt = runtime();
    let rt = rt.with_tma(false);
    let mut cases = Vec::new();
    for variant in ["causal", "document", "alibi"] {
        cases.push((spec(variant), Case::new((3, 3), (113, 203))));
        cases.push((spec(variant), Case { batch: 1, ..Case::new((2, 1), (1024, 1023)) }));
    }
    run_all(&rt, cases);
}

/// q_len > kv_len with a bottom-right causal mask leaves the first rows with
/// no key at all: their gradients must be 0, never NaN.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn fully_masked_rows() {
    let rt = runtime();
    let mut cases = Vec::new();
    for deterministic in [false, true] {
        let case = Case { deterministic, ..Case::new((2, 1), (300, 37)) };
        cases.push((spec("causal_bottom_right"), case));
    }
    run_all(&rt, cases);
}

/// The Hopper dK/dV kernel's producer walks the query heads of a group in
/// turn and tells the consumers which tile and head come next. A mask that
/// depends on the head leaves some heads of a group without a step for a
/// key tile (and some key tiles without any); documents without causality
/// leave runs of tiles only the block mask removes, which a warp tests 32 at
/// a time (in both dK/dV kernels).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn walks_over_heads_and_documents() {
    let rt = runtime();
    let parse = |source: &str| flashgen::parse_one(source).unwrap();
    let by_head = parse("ByHead { dtype: bf16, head_dim: 128, mask: k <= q + 64 * h }");
    let documents =
        parse("Documents { dtype: bf16, head_dim: 128, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }");
    let mut cases = Vec::new();
    for heads in [(4, 2), (4, 1)] {
        cases.push((by_head.clone(), Case::new(heads, (113, 700))));
        cases.push((documents.clone(), Case { batch: 1, ..Case::new(heads, (1024, 1023)) }));
    }
    // A block mask orders the dK/dV kernel's CTAs longest first (the key
    // order), over every head of a GQA group, in windows of 4 K/V heads (6:
    // a whole window and a part).
    for heads in [(2, 2), (4, 2), (6, 6)] {
        cases.push((documents.clone(), Case { block_mask: true, ..Case::new(heads, (300, 555)) }));
    }
    // Head dim 112: the mma.sync dK/dV kernel, whose threads all walk; 80:
    // the Hopper one with K's upper half copied again; 64: its smallest.
    for d in [112, 80, 64] {
        cases.push((with(documents.clone(), Dtype::Bf16, d, d), Case { batch: 1, ..Case::new((4, 2), (1024, 1023)) }));
    }
    run_all(&rt, cases);
}

/// More units (key tiles of (batch, K/V head) pairs) than a GPU has SMs:
/// each persistent dK/dV CTA (d = 64's 128-query steps) claims several in
/// turn, the next one's K and V copied while the last one's dK and dV are
/// stored, and the ring, the dQ additions and the tickets running on across
/// them; under a causal mask with fewer queries than keys many units visit
/// no step at all; with a block mask, units are claimed in its work order.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn persistent_units_in_turn() {
    let rt = runtime();
    let sms = rt.sm_count() as usize;
    // Key tiles of 128 keys over 16 (batch, K/V head) pairs: about two and a
    // half units per SM.
    let kv_len = (5 * sms / 2).div_ceil(16) * 128 - 5;
    let mut cases = Vec::new();
    for variant in ["full", "causal", "sliding_window", "gqa"] {
        let (batch, heads) = if variant == "gqa" { (4, (16, 4)) } else { (2, (8, 8)) };
        let spec = with(spec(variant), Dtype::Bf16, 64, 64);
        cases.push((spec, Case { batch, ..Case::new(heads, (300, kv_len)) }));
    }
    let documents = flashgen::parse_one(
        "Documents { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
    )
    .unwrap();
    cases.push((documents.clone(), Case { block_mask: true, ..Case::new((8, 8), (300, kv_len)) }));
    cases.push((documents, Case { block_mask: true, ..Case::new((8, 8), (300, kv_len)) }.deterministic()));
    run_all(&rt, cases);
}

/// Block masks built for the forward skip the same tiles in the backward.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn block_masks_are_reused() {
    let rt = runtime();
    let mut cases = Vec::new();
    for variant in ["document", "sliding_window", "prefix_lm"] {
        for deterministic in [false, true] {
            let case = Case { block_mask: true, deterministic, ..Case::new((2, 2), (300, 555)) };
            cases.push((spec(variant), case));
        }
    }
    run_all(&rt, cases);
}

/// Bad backward launches, and tunings on them, are typed errors, never
/// launches.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_backward_launches_are_rejected() {
    let rt = runtime();
    let spec = spec("alibi");
    let s = rt.stream();
    let layout = flashgen::Layout::bshd(1, 64, 2, 128);
    let x = s.alloc_zeros::<flashgen::half::bf16>(layout.len()).unwrap();
    let lse = s.alloc_zeros::<f32>(128).unwrap();
    let slopes = s.alloc_zeros::<f32>(2).unwrap();
    let (mut dq, mut dk) = (s.alloc_zeros(layout.len()).unwrap(), s.alloc_zeros(layout.len()).unwrap());
    let mut dv = s.alloc_zeros(layout.len() - 1).unwrap();
    let mut d_slopes = s.alloc_zeros::<f32>(1).unwrap();
    let mut io = flashgen::BackwardIo {
        q: (&x, layout),
        k: (&x, layout),
        v: (&x, layout),
        o: (&x, layout),
        lse: &lse,
        d_o: (&x, layout),
        dq: (&mut dq, layout),
        dk: (&mut dk, layout),
        dv: (&mut dv, layout),
        d_tensors: vec![Some(&mut d_slopes)],
    };
    let short_dv = |err: &Error| matches!(err, Error::OutOfBounds { operand: flashgen::codegen::abi::Operand::DV, .. });
    let err = rt.backward(&spec, io.reborrow(), &[(&slopes).into()], &Default::default()).unwrap_err();
    assert!(short_dv(&err), "{err}");
    // Tuning checks the launch first: the caller's error, not every tile's.
    let err = rt.autotune_backward(&spec, io, &[(&slopes).into()], &Default::default()).unwrap_err();
    assert!(short_dv(&err), "{err}");
}
