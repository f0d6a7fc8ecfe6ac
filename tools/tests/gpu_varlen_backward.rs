//! GPU correctness of the varlen (packed) backward: dQ, dK, dV and tensor
//! gradients of [`Runtime::backward_varlen`] judged with FlashAttention's
//! rule against the f64 varlen reference backward (each sequence a batch
//! row of its own lengths; see `flashgen_tools::verify::varlen`), as
//! `gpu_backward.rs` judges the dense backward.
//!
//! Each case runs the varlen forward (O, LSE) and then the backward on
//! fresh random inputs and ragged lengths with NaN-poisoned gradients (the
//! seed is printed with every row); the CPU references of all cases run in
//! parallel after the GPU runs. Head dims that pad to 64 through 128 (but
//! 112), 192 and 256 take the Hopper (wgmma) dK/dV kernel on an H100,
//! others the mma.sync one. Ignored by a
//! plain `cargo test`: they need a GPU; run them with `--include-ignored`,
//! where a missing GPU or any runtime error fails them.

mod support;

use flashgen::codegen::reference::VarlenProblem;
use flashgen::codegen::{Dtype, Spec};
use flashgen::half::bf16;
use flashgen::runtime::RaggedError;
use flashgen::{BackwardOptions, Error, PackedLayout, Runtime, Sequences, VarlenBackwardIo};
use flashgen_tools::verify::varlen::{
    check_backward_varlen, random_packed_d_out, random_varlen_problem, DeviceVarlen, Packing,
};
use flashgen_tools::verify::GpuGradients;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::backward::{same_on_a_second_run, GpuRuns};
use support::packed::{edge_length_cases, every_variant, packed_columns, GARBAGE_PREFIX_SUMS};
use support::{heads_of, params, runtime, spec, with};

/// One varlen backward case: a spec, its heads, its sequences' (queries,
/// keys), how the operands are packed, and the backward's mode.
#[derive(Clone)]
struct Case {
    spec: Spec,
    heads: (usize, usize),
    lens: Vec<(usize, usize)>,
    packing: Packing,
    deterministic: bool,
    /// Whether the run asks for the trainable tensors' gradients.
    tensor_grads: bool,
}

impl Case {
    fn new(spec: Spec, heads: (usize, usize), lens: Vec<(usize, usize)>) -> Case {
        Case { spec, heads, lens, packing: Packing::Thd, deterministic: false, tensor_grads: true }
    }

    fn deterministic(self) -> Case {
        Case { deterministic: true, ..self }
    }

    fn row(&self, seed: u64) -> String {
        format!(
            "{} {}{} seed={seed}",
            packed_columns(&self.spec, self.heads, &self.lens, self.packing),
            if self.deterministic { "deterministic" } else { "atomic" },
            if self.tensor_grads { "" } else { " no-tensor-grads" },
        )
    }
}

/// The varlen forward, then the backward (twice in the deterministic mode,
/// which must agree bit for bit).
fn run_once(rt: &Runtime, case: &Case, problem: &VarlenProblem, d_out: &[f64]) -> Result<GpuGradients, Error> {
    let spec = &case.spec;
    let mut gpu = DeviceVarlen::upload(rt, spec, problem, case.packing)?;
    gpu.launch(rt, spec, problem)?;
    let mode = (case.deterministic, case.tensor_grads);
    let grads = gpu.backward(rt, spec, problem, d_out, mode)?;
    if case.deterministic {
        let again = gpu.backward(rt, spec, problem, d_out, mode)?;
        same_on_a_second_run(spec, &grads, &again)?;
    }
    Ok(grads)
}

/// Runs every case on the GPU, then judges them all (see `GpuRuns::judge`).
fn run_all(rt: &Runtime, cases: Vec<Case>) {
    let mut runs = GpuRuns::new();
    for case in cases {
        let seed: u64 = rand::random();
        let problem = random_varlen_problem(&case.spec, case.heads, &case.lens, params(&case.spec), seed);
        let d_out = random_packed_d_out(&case.spec, &problem, seed);
        let gpu = run_once(rt, &case, &problem, &d_out);
        runs.record(case.row(seed), gpu, |grads| (case.spec, problem, d_out, grads));
    }
    runs.judge(|(spec, problem, d_out, grads)| {
        check_backward_varlen(spec, problem, d_out, grads).map_err(|e| e.to_string())
    });
}

/// Ragged lengths: an empty sequence, single tokens, queries without keys,
/// keys without queries, odd lengths, one sequence much longer than the
/// rest, shuffled.
fn ragged(rng: &mut StdRng) -> Vec<(usize, usize)> {
    support::ragged(rng, &[(0, 0), (0, 13), (1, 1), (1, 40), (5, 0), (17, 17), (600, 600)], (4, 90), |q, rng| {
        rng.random_range(q / 2..q + 120)
    })
}

/// Every example variant (trainable tensors included: ALiBi's slopes, the
/// relative bias) on ragged sequences, GQA: at their head dims, the Hopper
/// dK/dV kernel on an H100 where they pad to 64 through 128.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_on_ragged_sequences() {
    run_all(&runtime(), every_variant(ragged, Case::new));
}

/// The mma.sync dK/dV kernel (head dim 112: the Hopper one's tiles would
/// not fit shared memory), the Hopper one at head dims 96 (K's upper half
/// copied again) and 64, both dtypes, strided packed operands, odd head
/// dims, and the deterministic dQ kernel on both dK/dV paths.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mma_sync_path_layouts_and_modes() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for variant in ["causal", "sliding_window", "alibi", "document"] {
        for d in [112, 96, 64] {
            cases.push(Case::new(with(spec(variant), Dtype::Bf16, d, d), heads_of(variant), ragged(&mut rng)));
        }
    }
    let f16 = with(spec("causal_bottom_right"), Dtype::F16, 96, 96);
    cases.push(Case { packing: Packing::Padded, ..Case::new(f16, (6, 2), ragged(&mut rng)) });
    cases.push(Case::new(with(spec("causal"), Dtype::Bf16, 59, 59), (3, 3), ragged(&mut rng)));
    for variant in ["causal", "alibi"] {
        let padded = Case { packing: Packing::Padded, ..Case::new(spec(variant), (4, 2), ragged(&mut rng)) };
        cases.push(padded.deterministic());
        let d64 = with(spec(variant), Dtype::Bf16, 64, 64);
        cases.push(Case::new(d64, (4, 1), ragged(&mut rng)).deterministic());
    }
    // ALiBi's slopes without their gradient: a dK/dV kernel without the terms.
    cases.push(Case { tensor_grads: false, ..Case::new(spec("alibi"), (4, 2), ragged(&mut rng)) });
    run_all(&rt, cases);
}

/// The Hopper kernel above d = 128 (column halves at 256, transposed tiles
/// at 192 and 192/128) on ragged sequences: GQA, a tensor gradient (ALiBi;
/// with halves only one warpgroup adds it), padded packing and the
/// deterministic dQ kernel.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn wide_heads_on_ragged_sequences() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for (variant, qk, v) in [("causal", 256, 256), ("alibi", 192, 128), ("document", 192, 192)] {
        let spec = with(spec(variant), Dtype::Bf16, qk, v);
        cases.push(Case::new(spec.clone(), heads_of(variant), ragged(&mut rng)));
        let padded = Case { packing: Packing::Padded, ..Case::new(spec, (4, 2), ragged(&mut rng)) };
        cases.push(padded.deterministic());
    }
    run_all(&rt, cases);
}

/// The Hopper kernel's 128-query steps (d = 64, the runtime's choice for
/// analytic masks) on ragged sequences, whose last steps' second dQ tiles
/// lie past their queries: GQA, padded packing and the deterministic dQ
/// kernel.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn long_query_steps_on_ragged_sequences() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for variant in ["causal", "sliding_window", "full"] {
        let spec = with(spec(variant), Dtype::Bf16, 64, 64);
        cases.push(Case::new(spec.clone(), heads_of(variant), ragged(&mut rng)));
        let padded = Case { packing: Packing::Padded, ..Case::new(spec, (4, 2), ragged(&mut rng)) };
        cases.push(padded.deterministic());
    }
    run_all(&rt, cases);
}

/// One sequence alone, a single token, sequences without queries or keys,
/// rows with no key (their gradients 0) under a bottom-right mask, and many
/// short sequences beside a long one (the Hopper accumulator's tiles of
/// many sequences).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn edge_lengths() {
    let rt = runtime();
    let mut cases = edge_length_cases(700, Case::new);
    let mut lens = vec![(1, 1); 100];
    lens.extend([(65, 64), (63, 129), (64, 1)]);
    lens.push((900, 900));
    cases.push(Case::new(spec("causal"), (2, 2), lens.clone()));
    cases.push(Case::new(with(spec("causal"), Dtype::Bf16, 64, 64), (2, 2), lens));
    run_all(&rt, cases);
}

/// Prefix sums on the device that disagree with the buffers give some
/// result without any access outside the buffers (a fault would fail the
/// download and every later launch on the context), on both dK/dV paths
/// and in both modes.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_device_prefix_sums_stay_in_bounds() {
    let rt = runtime();
    let lens = [(40, 50), (30, 60), (20, 20)];
    for spec in [spec("causal"), with(spec("causal"), Dtype::Bf16, 64, 64)] {
        let problem = random_varlen_problem(&spec, (2, 1), &lens, vec![], rand::random());
        let d_out = random_packed_d_out(&spec, &problem, 1);
        let mut gpu = DeviceVarlen::upload(&rt, &spec, &problem, Packing::Thd).unwrap();
        gpu.launch(&rt, &spec, &problem).unwrap();
        for garbage in GARBAGE_PREFIX_SUMS.into_iter().chain([[-5, 40, 70, 1_000_000]]) {
            gpu.set_device_seqlens(&garbage, &garbage.map(|x| x.wrapping_mul(3))).unwrap();
            for deterministic in [false, true] {
                gpu.backward(&rt, &spec, &problem, &d_out, (deterministic, true))
                    .unwrap_or_else(|e| panic!("{} on {garbage:?}: {e}", spec.name));
            }
        }
    }
}

/// Bad varlen backward launches are typed errors, never launches.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_launches_are_rejected() {
    let rt = runtime();
    let spec = spec("alibi");
    let stream = rt.stream();
    let layout = PackedLayout::thd(100, 2, 128);
    let x = stream.alloc_zeros::<bf16>(layout.as_layout().len()).unwrap();
    let slopes = stream.alloc_zeros::<f32>(2).unwrap();
    let cu = stream.clone_htod(&[0i32, 50, 100]).unwrap();
    let shape = flashgen::Shape { batch: 2, heads: 2, heads_kv: 2, q_len: 50, kv_len: 50 };
    let block_mask = rt.block_mask(&spec, shape, &[(&slopes).into()]).unwrap();
    let launch = |lse_len: usize, dk: PackedLayout, d_slopes_len: usize, block_mask| {
        let lse = stream.alloc_zeros::<f32>(lse_len).unwrap();
        let [mut dq, mut dk_buf, mut dv] =
            [0; 3].map(|_| stream.alloc_zeros::<bf16>(layout.as_layout().len()).unwrap());
        let mut d_slopes = stream.alloc_zeros::<f32>(d_slopes_len).unwrap();
        let seqs = Sequences { batch: 2, cu_seqlens_q: &cu, cu_seqlens_k: &cu, max_q_len: 50, max_kv_len: 50 };
        let io = VarlenBackwardIo {
            q: (&x, layout),
            k: (&x, layout),
            v: (&x, layout),
            o: (&x, layout),
            lse: &lse,
            d_o: (&x, layout),
            dq: (&mut dq, layout),
            dk: (&mut dk_buf, dk),
            dv: (&mut dv, layout),
            d_tensors: vec![Some(&mut d_slopes)],
            seqs,
        };
        let opts = BackwardOptions { block_mask, ..Default::default() };
        rt.backward_varlen(&spec, io, &[(&slopes).into()], &opts).unwrap_err()
    };
    let err = launch(199, layout, 2, None);
    assert!(matches!(err, Error::LseTooSmall { len: 199, needed: 200 }), "{err}");
    let err = launch(200, PackedLayout::thd(99, 2, 128), 2, None);
    assert!(matches!(err, Error::SizeMismatch { .. }), "{err}");
    let err = launch(200, layout, 1, None);
    assert!(matches!(err, Error::TensorTooSmall { len: 1, needed: 2, .. }), "{err}");
    let err = launch(200, layout, 2, Some(&block_mask));
    assert!(matches!(err, Error::Ragged(RaggedError::VarlenBlockMask)), "{err}");
}
