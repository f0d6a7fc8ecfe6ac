//! GPU correctness of dropout on the attention probabilities
//! (`ForwardOptions::dropout`, `BackwardOptions::dropout`): the forward in
//! every configuration the GPU may pick (mma.sync and, on Hopper, the wgmma
//! kernels) and the backward (the portable dK/dV kernel at d = 64, the
//! Hopper one at d = 128, 192 and 256, the deterministic dQ kernel), judged with
//! FlashAttention's rule against the f64 reference given the same mask
//! (`codegen::dropout`, the CPU twin of the kernels' Philox); the mask read
//! back from the device equals the CPU's bit for bit and keeps a fraction
//! within 4σ of 1 − p; p = 0 is no dropout.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs and masks (the seeds are printed).

mod support;

use flashgen::codegen::reference::Problem;
use flashgen::codegen::{Dropout, Dtype, Shape, Spec};
use flashgen::runtime::{config_name, tile_choice};
use flashgen::{Error, Runtime};
use flashgen_tools::verify::{self, DeviceProblem, Expected, GpuGradients, OperandLayout};
use support::backward::{forward_then_backward, GpuRuns};
use support::forward::{Case, Table};
use support::{params, runtime, spec, with};

/// The cases' specs: a causal mask, a window (param), a softcap (score),
/// ALiBi (a trainable tensor), documents (an i32 tensor mask, with a block
/// mask), global tokens (a persistent forward's global rows first) and a
/// learned sink (trained), each at d = 64 in bf16 and d = 128 in f16.
fn dropout_specs() -> Vec<Spec> {
    let stems = ["causal", "sliding_window", "softcap", "alibi", "document", "longformer", "sink_window"];
    let dims = [(Dtype::Bf16, 64), (Dtype::F16, 128)];
    stems.iter().flat_map(|stem| dims.map(|(dtype, d)| with(spec(stem), dtype, d, d))).collect()
}

/// A random mask: p in [0.05, 0.5), any seed and offset (offsets past 2³²
/// too: their high word enters the key).
fn random_dropout() -> Dropout {
    Dropout { p: 0.05 + 0.45 * rand::random::<f32>(), seed: rand::random(), offset: rand::random() }
}

/// Compiles the dropout forward of every candidate configuration at once:
/// autotuning loads them in parallel (one after another, each case would
/// wait seconds for NVRTC). A failure here recurs in the cases, which
/// report it.
fn prefetch(rt: &Runtime, spec: &Spec, problem: &Problem, dropout: Dropout) {
    let _ = DeviceProblem::upload(rt, spec, problem, OperandLayout::Bshd).and_then(|mut gpu| {
        gpu.set_dropout(Some(dropout));
        gpu.autotune(rt, spec, problem)
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn forward_matches_the_reference_with_the_same_mask() {
    let rt = runtime();
    let mut table = Table::default();
    for spec in dropout_specs() {
        for (heads, seqs) in [((4, 2), (300, 517)), ((2, 1), (1024, 1023))] {
            let case = Case::new(heads, seqs);
            let seed: u64 = rand::random();
            let problem = verify::random_problem(&spec, case.shape(), params(&spec), vec![], None, seed);
            let dropout = random_dropout();
            let expected = Expected::dropout(&spec, &problem, dropout);
            prefetch(&rt, &spec, &problem, dropout);
            for config in tile_choice::candidates(&spec, rt.target()) {
                let block_mask = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
                let row = format!("{} {} {dropout:?}", case.row(&spec, seed), config_name(config));
                let outcome = expected.as_ref().map_err(|e| e.to_string()).and_then(|expected| {
                    let run = || -> Result<_, Error> {
                        let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, case.layout)?;
                        if block_mask {
                            gpu.build_block_mask(&rt, &spec, &problem)?;
                        }
                        gpu.pin_config(Some(config));
                        gpu.set_dropout(Some(dropout));
                        gpu.launch(&rt, &spec, &problem)?;
                        Ok(expected.check(&gpu.download()?))
                    };
                    run().map_err(|e| e.to_string())
                });
                table.record(row, outcome);
            }
        }
    }
    table.finish();
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn backward_matches_the_reference_with_the_same_mask() {
    let rt = runtime();
    let mut runs = GpuRuns::new();
    // Above d = 128 too: the Hopper kernel's transposed tiles (192/128, 192)
    // and column halves (256).
    let wide = [("causal", 192, 128), ("softcap", 192, 192), ("alibi", 256, 256)];
    let wide = wide.map(|(stem, qk, v)| with(spec(stem), Dtype::Bf16, qk, v));
    for spec in dropout_specs().into_iter().chain(wide) {
        for (heads, seqs, deterministic) in [((3, 3), (113, 203), false), ((4, 2), (300, 517), true)] {
            let shape = Case::new(heads, seqs).shape();
            let seed: u64 = rand::random();
            let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, seed);
            let d_out = verify::random_d_out(&spec, shape, seed);
            let dropout = random_dropout();
            let row = format!(
                "{:<14} {} d={} {shape:?} deterministic {deterministic} seed {seed} {dropout:?}",
                spec.name,
                spec.dtype.name(),
                spec.head_dims.qk
            );
            let gpu = forward_then_backward(&rt, &spec, &problem, &d_out, deterministic, Some(dropout));
            runs.record(row, gpu, |grads| (spec.clone(), problem, d_out, grads, dropout));
        }
    }
    runs.judge(|(spec, problem, d_out, grads, dropout)| {
        verify::check_backward_dropout(spec, problem, d_out, grads, Some(*dropout)).map_err(|e| e.to_string())
    });
}

/// A problem whose O is the kept mask: Q = 0 makes every P = 1 / kv_len,
/// and V the identity over kv_len = d keys, so O[b, q, h, k] is P times the
/// pair's factor: 0 exactly where (q, k) is dropped.
fn revealing_problem(spec: &Spec, batch: usize, heads: usize, q_len: usize) -> Problem {
    let d = spec.head_dims.qk as usize;
    let shape = Shape { batch, heads, heads_kv: heads, q_len, kv_len: d };
    let mut problem = verify::random_problem(spec, shape, vec![], vec![], None, 1);
    problem.q.iter_mut().for_each(|x| *x = 0.0);
    for (i, v) in problem.v.iter_mut().enumerate() {
        // V is [batch, kv_len, heads, d]: key i / (heads · d) % d, column i % d.
        *v = f64::from(u8::from(i / (heads * d) % d == i % d));
    }
    problem
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn device_mask_is_the_cpu_mask_and_keeps_one_minus_p() {
    let rt = runtime();
    let mut failures = Vec::new();
    for (dtype, d) in [(Dtype::Bf16, 64usize), (Dtype::F16, 128)] {
        let spec = with(spec("full"), dtype, d as u32, d as u32);
        let (batch, heads, q_len) = (3, 8, 1000);
        let problem = revealing_problem(&spec, batch, heads, q_len);
        prefetch(&rt, &spec, &problem, Dropout { p: 0.5, seed: 0, offset: 0 });
        for config in tile_choice::candidates(&spec, rt.target()) {
            for p in [0.1, 0.5, 0.9] {
                let dropout = Dropout { p, seed: rand::random(), offset: rand::random() };
                let row = format!("{} d={d} {} {dropout:?}", spec.dtype.name(), config_name(config));
                let o = (|| -> Result<Vec<f64>, Error> {
                    let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, OperandLayout::Bshd)?;
                    gpu.pin_config(Some(config));
                    gpu.set_dropout(Some(dropout));
                    gpu.launch(&rt, &spec, &problem)?;
                    Ok(gpu.download()?.o)
                })();
                let o = match o {
                    Ok(o) => o,
                    Err(e) => {
                        println!("ERROR  {row}  {e}");
                        failures.push(row);
                        continue;
                    }
                };
                let (mut kept, mut mismatches) = (0usize, 0usize);
                for b in 0..batch {
                    for q in 0..q_len {
                        for h in 0..heads {
                            for k in 0..d {
                                let on_gpu = o[((b * q_len + q) * heads + h) * d + k] != 0.0;
                                kept += usize::from(on_gpu);
                                mismatches += usize::from(on_gpu != dropout.keeps(b, h, heads, q, k));
                            }
                        }
                    }
                }
                let n = batch * heads * q_len * d;
                let keep = 1.0 - f64::from(p);
                let sigma = (keep * (1.0 - keep) / n as f64).sqrt();
                let fraction = kept as f64 / n as f64;
                let ok = mismatches == 0 && (fraction - keep).abs() <= 4.0 * sigma;
                println!(
                    "{} {row}  kept {fraction:.5} (1 - p = {keep:.5} ± 4σ {:.5}), {mismatches} pairs unlike the CPU's",
                    if ok { "ok    " } else { "FAILED" },
                    4.0 * sigma
                );
                if !ok {
                    failures.push(row);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n"));
}

/// p = 0 runs the kernels without dropout: O, the LSE and the gradients are
/// those of a launch without the option, bit for bit.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn zero_p_is_no_dropout() {
    let rt: Runtime = runtime();
    for spec in [with(spec("causal"), Dtype::Bf16, 128, 128), with(spec("alibi"), Dtype::F16, 64, 64)] {
        let shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 333, kv_len: 444 };
        let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, 5);
        let d_out = verify::random_d_out(&spec, shape, 5);
        let run = |dropout| -> (Vec<f64>, Vec<f64>, GpuGradients) {
            let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, OperandLayout::Bshd).unwrap();
            gpu.set_dropout(dropout);
            gpu.launch(&rt, &spec, &problem).unwrap();
            let out = gpu.download().unwrap();
            (out.o, out.lse, gpu.backward(&rt, &spec, &problem, &d_out, true, true, None).unwrap())
        };
        let plain = run(None);
        let zero = run(Some(Dropout { p: 0.0, seed: 3, offset: 4 }));
        let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain.0), bits(&zero.0), "{}: O", spec.name);
        assert_eq!(bits(&plain.1), bits(&zero.1), "{}: LSE", spec.name);
        assert_eq!(bits(&plain.2.dq), bits(&zero.2.dq), "{}: dQ", spec.name);
        assert_eq!(bits(&plain.2.dk), bits(&zero.2.dk), "{}: dK", spec.name);
        assert_eq!(bits(&plain.2.dv), bits(&zero.2.dv), "{}: dV", spec.name);
    }
}
