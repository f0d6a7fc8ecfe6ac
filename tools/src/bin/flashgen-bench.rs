//! Forward-pass benchmark over the peer suite of `../shared/anchors.md`:
//! bf16, 16 heads, batch × seqlen = 32768 tokens, random N(0, 1) inputs,
//! median of CUDA-event timings taken as triton's `do_bench` takes the
//! peers' (`sustained_median_ms`: 25 ms of warm-up, then 100 ms of
//! launches queued back to back, at least `--iters` of them, so that both
//! run at the clock the GPU's power limit allows under sustained load),
//! each launch after 256 MB of zeros written to flush the L2 (what
//! `do_bench` does, in place of rotating input buffers: every launch
//! starts from a cold cache).
//! TFLOP/s = 4·b·h·s²·d · density / time, density = the kept fraction of
//! (q, k) pairs, counted exactly (2·b·h·s²·(d_qk + d_v) · density where
//! the head dims differ).
//!
//! `flashgen-bench [--variants causal,full] [--dims 64,128,192/128] [--seqs 1024,4096,16384] [--iters 20] [--backward] [--bwd-tiles T/T] [--tune] [--varlen]`
//!
//! Variants (`VARIANTS`): `full`, `causal`, `swa1024` (a causal 1024-key
//! window), `doc` (4 documents, a block mask), `softcap-causal`,
//! `alibi-causal`, `longformer` (a band of half-width 256 plus 32 global
//! rows and columns) and `sink-window` (4 sink keys plus a causal 1024-key
//! window); `bench/peers.py` gives flex the same masks. `swa1024-sinks`
//! (not in the default list, no peer) is `swa1024` with a learned sink
//! logit per head (`sink: sinks[h]`, gpt-oss).
//!
//! `--dims` takes head dims `d` or `d_qk/d_v` (DeepSeek's 192/128).
//!
//! `--backward` also times one training step (forward, then backward into
//! Q, K and V, no tensor gradients, as the peers' steps) per variant and
//! shape, as rows `<variant>+bwd`
//! counting 3.5x the forward FLOPs.
//!
//! `--bwd-tiles 4,whole,32/8,halves,32/wgmma` times the step once per
//! dK/dV tile instead (rows `<variant>+bwd@<tile>`): `warps,columns,block_m`
//! of the `mma.sync` kernel (`whole` or `halves`), or `wgmma` for Hopper's;
//! a tile that is not one of `BackwardConfig::tiles` for the spec on the GPU
//! gives an error row. `--bwd-tiles all` times every tile of each spec.
//! The `--varlen` and `--packed` rows' steps take the same tiles.
//!
//! `--dropout P` runs the suite's forward and training steps with dropout
//! on P at probability P (rows `<variant>+drop`, `<variant>+drop+bwd`; no
//! varlen rows, which have no dropout).
//!
//! `--e4m3` adds a row `<variant>-e4m3` after each forward row: the same
//! inputs quantized to e4m3 with per-K/V-head descales, launched with
//! `Runtime::forward_e4m3` (the V-tile kernel it runs first included).
//! `--e4m3-tiles 128,192,w12:160` instead adds a row `<variant>-e4m3-<tile>`
//! per key tile: `n` keys with two consumer warpgroups, `wW:n` with W warps.
//!
//! `--varlen` adds a row `doc-varlen` after each `doc` row: the same
//! documents packed as varlen sequences (each attending within itself, the
//! pairs the document mask keeps), launched with `Runtime::forward_varlen`:
//! the same FLOPs without a mask or a block mask. With `--backward` too, a
//! row `doc-varlen+bwd` times its training step (`Runtime::forward_varlen`,
//! then `Runtime::backward_varlen` into Q, K and V), against `doc+bwd`.
//!
//! `--packed` instead times packed training batches: 32768 tokens as 8 and
//! as 64 causal documents of uneven lengths (`document_lengths`, the formula
//! `bench/packed_peers.py` shares), rows `pack<N>-varlen` (the varlen
//! forward), `pack<N>-doc` (one dense sequence with the document-causal
//! mask and its block mask, whose build gets a row of its own) and
//! `pack<N>-even` (a dense causal launch of N equal documents: the rate
//! the varlen rows aim for). TFLOP/s count the kept pairs. With
//! `--backward`, each gets a `+bwd` row: its training step (the varlen one
//! through `Runtime::backward_varlen`), counting 3.5x the forward FLOPs.
//!
//! `--tune` autotunes each variant and shape first, the forward and with
//! `--backward` the dK/dV tile (`Runtime::autotune`, `autotune_backward`;
//! remembered in the kernel cache): a `tune` line each lists every
//! candidate's median time; the forward rows gain a column naming their
//! configuration. Without it, rows run what the runtime would: an earlier
//! tuning's choice from the cache, else the preferred one.
//!
//! `flashgen-bench --decode [--batches 1,16,64,256] [--kv-lens 1024,4096,16384,65536]`
//! instead times the decode path (`flashgen_tools::decode_bench`): GB/s of
//! K and V per batch and cache length, on a dense cache and on 16-row
//! pages, and a device-to-device copy row. `--untracked` turns cudarc's
//! event tracking off first (as a CUDA-graph capture does), so the host
//! time counts no event recorded per buffer, and each row also gets the
//! host time of replaying its step captured in a CUDA graph. `--e4m3` adds each row on e4m3
//! caches (GB/s of the bytes they read). `--decode-heads 32/8,64/8` and
//! `--decode-dims 128,256` pick the models (query / K/V heads, head dim;
//! each pair its own table), `--decode-variants causal,alibi,softcap,sinks`
//! the specs (`decode_bench::VARIANTS`). `flashgen-bench --decode-mla
//! [--mla-heads 16,128]` times MLA's absorbed decode instead (QK 576 / V
//! 512, one K/V head, V a view of K), GB/s of the one cache a step reads.
//! `--splits 0,8,32` times each row at every listed split count (0: the
//! plan's own, which `--tune` tunes first: `DecodePlan::tune`).
//!
//! `flashgen-bench --prefill [--cached 0,8192,30720]` instead times chunked
//! prefill against a paged cache (`flashgen_tools::prefill_bench`): pages of
//! 16 and 256 rows against the dense-KV launch of the same shape.
//!
//! `flashgen-bench --cp [--lens 131072,524288] [--cp-variants
//! causal,document,window]` instead times context parallelism over every
//! visible GPU against the unsharded launch (`flashgen_tools::cp_bench`).
//!
//! `flashgen-bench --jit` instead measures the JIT for every example spec:
//! cold compile of the kernel the runtime launches untuned on this GPU
//! (codegen + NVRTC to CUBIN, NVRTC already loaded; NVRTC 13's own compute
//! cache, which answers a source it compiled before in ~40 ms even across
//! processes, is turned off), every kernel of a training step compiled all
//! at once by `Runtime::prepare` in a fresh runtime without a disk cache, a
//! disk cache hit to a launchable kernel in a fresh runtime, and the host
//! time of one launch on an in-memory hit.
//! `flashgen-bench --jit-cpu [--arch sm_90]` needs no GPU: cold compiles of
//! that forward and of every kernel of a training step, one by one and all
//! at once (`flashgen_tools::jit_bench`).

use flashgen::codegen::analysis::{classify, TileClass};
use flashgen::codegen::cuda::{BackwardTile, TileConfig};
use flashgen::codegen::reference::{ParamValue, Problem, TensorData, VarlenProblem};
use flashgen::codegen::{Dropout, Shape};
use flashgen::runtime::{config_name, KvCacheDtype};
use flashgen::Runtime;
use flashgen_tools::decode_bench;
use flashgen_tools::jit_bench;
use flashgen_tools::step_tiles::{parse_e4m3_tile, parse_step_tiles, step_row, StepTiles};
use flashgen_tools::verify::decode_e4m3::Granularity;
use flashgen_tools::verify::forward_e4m3::{quantize_operands, E4m3Operands};
use flashgen_tools::verify::{self, DeviceProblem, OperandLayout};
use std::time::Instant;

const TOKENS: usize = 32768;
/// Zeros written before every timed launch: the peers' `do_bench` flush.
const L2_FLUSH_BYTES: usize = 256 << 20;
const HEADS: usize = 16;
const WINDOW: usize = 1024;
const DOCS: usize = 4;
/// `longformer`: the band's half-width (Longformer's 512-key window) and
/// the global tokens, rows and columns.
const BAND: usize = 256;
const GLOBALS: usize = 32;
/// `sink-window`: StreamingLLM's 4 sink keys, beside a WINDOW-key window.
const SINKS: usize = 4;
/// `prefix-lm`: the prefix every query sees whole (a prompt), causal after.
const PREFIX: usize = 1024;

/// The suite's variants: name and spec body (dtype and head_dim prepended).
const VARIANTS: [(&str, &str); 10] = [
    ("full", ""),
    ("causal", "mask: q >= k,"),
    ("swa1024", "param window: i32, mask: q >= k && q - k < window,"),
    ("doc", "tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k],"),
    ("softcap-causal", "mask: q >= k, score: 30.0 * tanh(score / 30.0),"),
    ("alibi-causal", "tensor slopes: f32[H], mask: q >= k, score: score + slopes[h] * (k - q) as f32,"),
    (
        "longformer",
        "param window: i32, param globals: i32, \
         mask: (q - k <= window && k - q <= window) || q < globals || k < globals,",
    ),
    ("sink-window", "param sinks: i32, param window: i32, mask: k < sinks || (q >= k && q - k < window),"),
    ("prefix-lm", "param prefix: i32, mask: k < prefix || q >= k,"),
    ("swa1024-sinks", "param window: i32, tensor sinks: f32[H], mask: q >= k && q - k < window, sink: sinks[h],"),
];

/// Runs the bench `args` names other than the variant suite and `--jit`
/// (`--jit-cpu`, `--prefill`, `--cp`, `--decode`), if any; whether one ran.
fn other_bench(args: &[String], list: &dyn Fn(&str, &str) -> Vec<String>, iters: usize) -> bool {
    let sizes = |flag, default| list(flag, default).iter().filter_map(|s| s.parse().ok()).collect::<Vec<usize>>();
    if args.iter().any(|a| a == "--jit-cpu") {
        let arch = list("--arch", "sm_90")[0].parse::<flashgen::runtime::Arch>();
        if let Err(e) = arch.map_err(|e| e.to_string()).and_then(|a| jit_bench::run(a).map_err(|e| e.to_string())) {
            eprintln!("flashgen-bench --jit-cpu: {e}");
            std::process::exit(2);
        }
    } else if args.iter().any(|a| a == "--prefill") {
        flashgen_tools::prefill_bench::run(&start_runtime(), &sizes("--cached", "0,8192,30720"), iters);
    } else if args.iter().any(|a| a == "--cp") {
        let variants = list("--cp-variants", "causal,document,window");
        flashgen_tools::cp_bench::run(&sizes("--lens", "131072,524288"), &variants, iters);
    } else if args.iter().any(|a| a == "--decode" || a == "--decode-mla") {
        let (batches, kv_lens) = (sizes("--batches", "1,16,64,256"), sizes("--kv-lens", "1024,4096,16384,65536"));
        let splits = sizes("--splits", "0");
        let tune = args.iter().any(|a| a == "--tune");
        // The GQA rows' models, checked before the GPU is looked for.
        let flags = ["--decode-variants", "--decode-dims", "--decode-heads"];
        let [variants, dims, heads] =
            flags.map(|flag| list(flag, "").into_iter().filter(|v| !v.is_empty()).collect::<Vec<String>>());
        let models = decode_bench::models(&variants, &dims, &heads).unwrap_or_else(|e| {
            eprintln!("flashgen-bench --decode: {e}");
            std::process::exit(2);
        });
        let rt = start_runtime();
        if args.iter().any(|a| a == "--untracked") {
            // SAFETY: every buffer of the bench lives on the runtime's one stream.
            unsafe { rt.context().disable_event_tracking() };
        }
        let formats: &[KvCacheDtype] = match args.iter().any(|a| a == "--e4m3") {
            true => &[KvCacheDtype::Spec, KvCacheDtype::E4m3],
            false => &[KvCacheDtype::Spec],
        };
        use decode_bench::{run, DecodeModel};
        if args.iter().any(|a| a == "--decode-mla") {
            // MLA refuses e4m3 caches (V head dim 512): 16-bit rows only.
            for heads in sizes("--mla-heads", "128") {
                let model = DecodeModel::mla(heads);
                run(&rt, &model, (&batches, &kv_lens), (&[KvCacheDtype::Spec], &splits, tune), iters);
            }
        } else {
            for model in &models {
                run(&rt, model, (&batches, &kv_lens), (formats, &splits, tune), iters);
            }
        }
    } else {
        return false;
    }
    true
}

/// The options of a suite run (the default mode).
struct Suite {
    variants: Vec<String>,
    iters: usize,
    backward: bool,
    tune: bool,
    varlen: bool,
    /// Also time the forward on e4m3 operands (with these tiles, if any).
    e4m3: bool,
    e4m3_tiles: Vec<String>,
    dropout: Option<Dropout>,
    step_tiles: StepTiles,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let list = |flag: &str, default: &str| -> Vec<String> {
        let value = args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
        value.map_or(default, |v| v.as_str()).split(',').map(str::to_string).collect()
    };
    let dims: Vec<Dims> = list("--dims", "128,64").iter().filter_map(|d| Dims::parse(d)).collect();
    let seqs: Vec<usize> = list("--seqs", "1024,4096,16384").iter().filter_map(|s| s.parse().ok()).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let e4m3_tiles: Vec<String> = list("--e4m3-tiles", "").into_iter().filter(|t| !t.is_empty()).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
    let step_tiles = match parse_step_tiles(value("--bwd-tiles").map_or("", |v| v.as_str())) {
        Ok(tiles) => tiles,
        Err(e) => return eprintln!("--bwd-tiles: {e}"),
    };
    let suite = Suite {
        variants: list("--variants", "full,causal,swa1024,doc,softcap-causal,alibi-causal,longformer,sink-window"),
        iters: list("--iters", "20")[0].parse().unwrap_or(20),
        tune: flag("--tune"),
        varlen: flag("--varlen"),
        e4m3: flag("--e4m3") || !e4m3_tiles.is_empty(),
        e4m3_tiles,
        dropout: list("--dropout", "0")[0].parse().ok().filter(|&p| p > 0.0).map(|p| Dropout { p, seed: 1, offset: 0 }),
        backward: flag("--backward") || !matches!(step_tiles, StepTiles::Preferred),
        step_tiles,
    };

    if flag("--jit") {
        return cold_jit();
    }
    if other_bench(&args, &list, suite.iters) {
        return;
    }
    let rt = start_runtime();
    println!(
        "device: {} ({}), bf16, {HEADS} heads, {TOKENS} tokens per batch, median over 100 ms of launches (at least {})",
        rt.device_name(),
        rt.arch(),
        suite.iters
    );
    if flag("--packed") {
        return packed_documents(&rt, &suite, &dims);
    }
    println!(
        "{:<16} {:>4} {:>6} {:>3} {:>10} {:>9} {:>8} {:>15}{}",
        "variant",
        "d",
        "s",
        "b",
        "ms",
        "TFLOP/s",
        "density",
        "tiles visited",
        if suite.tune { "  config" } else { "" }
    );
    for &d in &dims {
        for &s in &seqs {
            bench_shape(&rt, &suite, d, s);
        }
    }
}

/// Every variant of the suite at head dims `d` and sequence length `s`, on
/// one draw of Q/K/V.
fn bench_shape(rt: &Runtime, suite: &Suite, d: Dims, s: usize) {
    let batch = (TOKENS / s).max(1);
    let shape = Shape { batch, heads: HEADS, heads_kv: HEADS, q_len: s, kv_len: s };
    // One draw of Q/K/V per shape, shared by the variants.
    let full = flashgen::parse_one(&format!("Full {{ dtype: bf16, {} }}", d.fields())).expect("valid spec");
    let mut problem = verify::random_problem(&full, shape, vec![], vec![], None, s as u64);
    // The same draw quantized to e4m3 (per-K/V-head descales), shared
    // by the variants too: quantizing takes longer than a row's timing.
    let mut quantized = suite.e4m3.then(|| {
        let mut inputs = problem.clone();
        let operands = quantize_operands(&full, &mut inputs, Granularity::PerKvHead);
        (inputs, operands)
    });
    // Uploaded once too: the variants change params and tensors only.
    let uploaded = DeviceProblem::upload(rt, &full, &problem, OperandLayout::Bshd)
        .and_then(|mut gpu| gpu.flush_l2(L2_FLUSH_BYTES).map(|()| gpu));
    let mut gpu = match uploaded {
        Ok(gpu) => gpu,
        Err(e) => return println!("{:<16} {d:>4} {s:>6} {batch:>3} error: {e}", "(inputs)"),
    };
    for name in &suite.variants {
        let Some((_, body)) = VARIANTS.iter().find(|(n, _)| n == name) else {
            eprintln!("unknown variant `{name}`");
            continue;
        };
        let spec = flashgen::parse_one(&format!("Bench {{ dtype: bf16, {}, {body} }}", d.fields()))
            .expect("bench specs are valid");
        let density;
        (problem.params, problem.tensors, density) = inputs(name, batch, s);
        let name = &suite.dropout.map_or_else(|| name.clone(), |_| format!("{name}+drop"));
        let mut tiles = visited_tiles(&spec, &problem);
        let timed = gpu.reuse_for(&spec, &problem).and_then(|()| {
            gpu.set_dropout(suite.dropout);
            // Data-dependent masks get a block mask, built (and timed) first.
            if spec.mask.as_ref().is_some_and(flashgen::codegen::Expr::reads_tensor) {
                let (ms, kept) = time_block_mask(rt, &mut gpu, &spec, &problem)?;
                tiles = kept;
                println!("{name:<16} {d:>4} {s:>6} {batch:>3} {ms:>10.3} block-mask build");
            }
            // compare.py skips these lines: the third word is no number.
            let config = if suite.tune {
                let report = gpu.autotune(rt, &spec, &problem)?;
                println!("tune {name} d={d} s={s} {report}");
                format!("  {}", config_name(report.best))
            } else {
                String::new()
            };
            let iters = suite.iters;
            let forward = gpu.time(rt, &spec, &problem, iters)?;
            if suite.tune && suite.backward && matches!(suite.step_tiles, StepTiles::Preferred) {
                println!("tune {name}+bwd d={d} s={s} {}", gpu.autotune_backward(rt, &spec, &problem)?);
            }
            // A step per dK/dV tile asked for, else one in the runtime's choice.
            let steps = time_steps(rt, suite, &spec, name, |tile| {
                gpu.pin_backward_tile(tile);
                gpu.time_forward_backward(rt, &spec, &problem, iters)
            });
            gpu.pin_backward_tile(None);
            // Last: later launches of `gpu` run the e4m3 forward.
            let quantized = match quantized.as_mut() {
                Some(inputs) => time_e4m3(rt, &mut gpu, &spec, &problem, inputs, &suite.e4m3_tiles, iters)?,
                None => Vec::new(),
            };
            Ok((forward, steps, config, quantized))
        });
        let row = format!("{name:<16} {d:>4} {s:>6} {batch:>3}");
        match timed {
            Ok((ms, steps, config, quantized)) => {
                let flops = d.flops_per_pair() * (batch * HEADS) as f64 * (s * s) as f64 * density;
                let tflops = flops / (ms * 1e-3) / 1e12;
                println!("{row} {ms:>10.3} {tflops:>9.1} {density:>8.4} {tiles:>15}{config}");
                let quantized = quantized.into_iter().map(|(suffix, ms)| (format!("{name}-{suffix}"), ms, flops, ""));
                let steps = steps.into_iter().map(|(name, ms)| (name, ms, 3.5 * flops, config.as_str()));
                for (name, ms, flops, config) in quantized.chain(steps) {
                    match ms {
                        Ok(ms) => println!(
                            "{name:<16} {d:>4} {s:>6} {batch:>3} {ms:>10.3} {:>9.1} {density:>8.4}{config}",
                            flops / (ms * 1e-3) / 1e12
                        ),
                        Err(e) => println!("{name:<16} {d:>4} {s:>6} {batch:>3} error: {e}"),
                    }
                }
            }
            Err(e) => println!("{row} error: {e}"),
        }
        if suite.varlen && name == "doc" {
            varlen_documents(rt, suite, &problem, d);
        }
    }
}

/// A timed launch's median milliseconds, or why it did not run.
type Timed = Result<f64, flashgen::Error>;

/// Times `gpu`'s problem on its Q, K and V as `quantized` holds them
/// (quantized to e4m3, and their operands), in each of `tiles`
/// (`--e4m3-tiles`; none: the runtime's choice): a row suffix and the
/// median milliseconds of each. Later launches of `gpu` run the e4m3
/// forward.
fn time_e4m3(
    rt: &Runtime,
    gpu: &mut DeviceProblem,
    spec: &flashgen::Spec,
    problem: &Problem,
    (quantized, operands): &mut (Problem, E4m3Operands),
    tiles: &[String],
    iters: usize,
) -> Result<Vec<(String, Timed)>, flashgen::Error> {
    // The variant's params and tensors beside the shared operands.
    quantized.params.clone_from(&problem.params);
    quantized.tensors.clone_from(&problem.tensors);
    gpu.use_e4m3(operands)?;
    let tiles: Vec<Option<&String>> = match tiles.is_empty() {
        true => vec![None],
        false => tiles.iter().map(Some).collect(),
    };
    let mut rows = Vec::new();
    for tile in tiles {
        gpu.pin_config(tile.and_then(|t| parse_e4m3_tile(t)));
        let suffix = tile.map_or("e4m3".to_string(), |t| format!("e4m3-{t}"));
        rows.push((suffix, gpu.time(rt, spec, quantized, iters)));
    }
    Ok(rows)
}

/// Times the documents of `dense`'s `doc` ids as packed varlen sequences
/// and prints a `doc-varlen` row (its TFLOP/s over the pairs kept) and,
/// with `--backward`, rows for its training step in the suite's tiles.
fn varlen_documents(rt: &Runtime, suite: &Suite, dense: &Problem, d: Dims) {
    let Some(TensorData::I32(ids)) = dense.tensors.first() else { return };
    let (batch, s) = (dense.shape.batch, dense.shape.q_len);
    let mut lens = Vec::new();
    for row in ids.chunks(s) {
        lens.extend(row.chunk_by(|a, b| a == b).map(|doc| (doc.len(), doc.len())));
    }
    let kept: usize = lens.iter().map(|&(q, k)| q * k).sum();
    let spec = flashgen::parse_one(&format!("Full {{ dtype: bf16, {} }}", d.fields())).expect("valid spec");
    let problem = verify::varlen::random_varlen_problem(&spec, (HEADS, HEADS), &lens, vec![], s as u64);
    let rows = time_varlen(rt, suite, &spec, &problem, "doc-varlen");
    let density = kept as f64 / (batch * s * s) as f64;
    let flops = d.flops_per_pair() * (HEADS * kept) as f64;
    print_rows(&rows, &format!("{d:>4} {s:>6} {batch:>3}"), flops, density);
}

/// Times varlen `problem`'s forward (row `name`) and, with `--backward`,
/// its training step in each of the suite's tiles, L2 flushed.
fn time_varlen(
    rt: &Runtime,
    suite: &Suite,
    spec: &flashgen::Spec,
    problem: &VarlenProblem,
    name: &str,
) -> Vec<(String, Timed)> {
    let upload = verify::varlen::DeviceVarlen::upload(rt, spec, problem, verify::varlen::Packing::Thd);
    let mut gpu = match upload {
        Ok(gpu) => gpu,
        Err(e) => return vec![(name.to_string(), Err(e))],
    };
    let mut rows = vec![(name.to_string(), gpu.time(rt, spec, problem, L2_FLUSH_BYTES, suite.iters))];
    rows.extend(time_steps(rt, suite, spec, name, |tile| {
        gpu.pin_backward_tile(tile);
        gpu.time_forward_backward(rt, spec, problem, L2_FLUSH_BYTES, suite.iters)
    }));
    rows
}

/// The training-step rows of forward row `name` (none without
/// `--backward`): one per dK/dV tile the suite asks for, each timed by
/// `time` with that tile (`None`: the runtime's choice).
fn time_steps(
    rt: &Runtime,
    suite: &Suite,
    spec: &flashgen::Spec,
    name: &str,
    mut time: impl FnMut(Option<BackwardTile>) -> Timed,
) -> Vec<(String, Timed)> {
    let tiles = suite.step_tiles.of(spec, rt.target());
    tiles.into_iter().filter(|_| suite.backward).map(|tile| (step_row(name, tile), time(tile))).collect()
}

/// Prints timed rows after their shape columns `shape`: a forward's of
/// `flops`, its training steps' (`+bwd` in the name) of 3.5x as many.
fn print_rows(rows: &[(String, Timed)], shape: &str, flops: f64, density: f64) {
    for (name, ms) in rows {
        let flops = if name.contains("+bwd") { 3.5 * flops } else { flops };
        match ms {
            Ok(ms) => println!("{name:<16} {shape} {ms:>10.3} {:>9.1} {density:>8.4}", flops / (ms * 1e-3) / 1e12),
            Err(e) => println!("{name:<16} {shape} error: {e}"),
        }
    }
}

/// A row's head dims: Q/K's and V's.
#[derive(Clone, Copy)]
struct Dims {
    qk: u32,
    v: u32,
}

impl Dims {
    /// `d` or `d_qk/d_v`.
    fn parse(text: &str) -> Option<Dims> {
        let (qk, v) = text.split_once('/').unwrap_or((text, text));
        Some(Dims { qk: qk.parse().ok()?, v: v.parse().ok()? })
    }

    /// The spec's head-dim settings.
    fn fields(self) -> String {
        format!("head_dim: {}, v_head_dim: {}", self.qk, self.v)
    }

    /// FLOPs of one kept (q, k) pair: its dot product and its share of P V.
    fn flops_per_pair(self) -> f64 {
        2.0 * f64::from(self.qk + self.v)
    }
}

impl std::fmt::Display for Dims {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self.qk == self.v {
            true => f.pad(&self.qk.to_string()),
            false => f.pad(&format!("{}/{}", self.qk, self.v)),
        }
    }
}

/// `--jit` on a fresh cache directory, set before any runtime reads the
/// environment, and without NVRTC's compute cache (~/.nv/ComputeCache),
/// turned off before NVRTC loads.
fn cold_jit() {
    let dir = std::env::temp_dir().join(format!("flashgen-jit-{}", std::process::id()));
    std::env::set_var("FLASHGEN_CACHE_DIR", &dir);
    std::env::set_var("CUDA_CACHE_DISABLE", "1");
    jit_bench::run_gpu(&start_runtime());
    let _ = std::fs::remove_dir_all(dir);
}

fn start_runtime() -> Runtime {
    Runtime::new(0).unwrap_or_else(|e| {
        eprintln!("flashgen-bench needs a GPU: {e}");
        std::process::exit(2);
    })
}

/// Median wall time of building the block mask (after one warm-up build),
/// and the tiles it keeps per (batch, head) slice, out of all.
fn time_block_mask(
    rt: &Runtime,
    gpu: &mut DeviceProblem,
    spec: &flashgen::Spec,
    problem: &Problem,
) -> Result<(f64, String), flashgen::Error> {
    let sync = |rt: &Runtime| rt.stream().synchronize().map_err(|e| flashgen::Error::driver("build", e));
    let mut times = Vec::new();
    for _ in 0..6 {
        let start = Instant::now();
        gpu.build_block_mask(rt, spec, problem)?;
        sync(rt)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.remove(0);
    times.sort_by(f64::total_cmp);
    let mask = gpu.build_block_mask(rt, spec, problem)?;
    let classes = mask.classes(rt)?;
    let (q_tiles, kv_tiles) = mask.tiles();
    let per_slice = q_tiles * kv_tiles;
    let kept = classes.iter().filter(|&&c| c != 0).count() / (classes.len() / per_slice.max(1)).max(1);
    Ok((times[times.len() / 2], format!("{kept}/{per_slice}")))
}

/// Block-mask tiles the kernel visits per (batch, head), out of all, by the same
/// interval analysis the kernel runs (batch 0, head 0).
fn visited_tiles(spec: &flashgen::Spec, problem: &Problem) -> String {
    let (bm, bn) = TileConfig::mask_tile(spec);
    let (bm, bn) = (bm as usize, bn as usize);
    let Shape { q_len, kv_len, .. } = problem.shape;
    let (mut visited, mut total) = (0, 0);
    for q0 in (0..q_len).step_by(bm) {
        for k0 in (0..kv_len).step_by(bn) {
            let q = (q0 as i32, ((q0 + bm).min(q_len) - 1) as i32);
            let k = (k0 as i32, ((k0 + bn).min(kv_len) - 1) as i32);
            total += 1;
            visited += usize::from(classify(spec, &problem.shape, &problem.params, 0, 0, q, k) != TileClass::Empty);
        }
    }
    format!("{visited}/{total}")
}

/// Params, captured tensors and the exact kept fraction for one variant.
fn inputs(name: &str, batch: usize, s: usize) -> (Vec<ParamValue>, Vec<TensorData>, f64) {
    let pairs = (s * s) as f64;
    match name {
        "causal" | "softcap-causal" => (vec![], vec![], (s * (s + 1) / 2) as f64 / pairs),
        "alibi-causal" => {
            let slopes = (0..HEADS).map(|h| 2f64.powf(-8.0 * (h + 1) as f64 / HEADS as f64)).collect();
            (vec![], vec![TensorData::Float(slopes)], (s * (s + 1) / 2) as f64 / pairs)
        }
        "swa1024" | "swa1024-sinks" => {
            let kept: usize = (0..s).map(|q| (q + 1).min(WINDOW)).sum();
            // gpt-oss's learned sinks: one logit per head.
            let sinks = (0..HEADS).map(|h| 0.25 * h as f64 - 1.0).collect();
            let tensors = if name == "swa1024" { vec![] } else { vec![TensorData::Float(sinks)] };
            (vec![ParamValue::I32(WINDOW as i32)], tensors, kept as f64 / pairs)
        }
        "longformer" => {
            // A global row keeps every key; another its band and the global
            // columns below the band.
            let row = |q: usize| {
                let lo = q.saturating_sub(BAND);
                if q < GLOBALS {
                    s
                } else {
                    (q + BAND).min(s - 1) - lo + 1 + GLOBALS.min(lo)
                }
            };
            let kept: usize = (0..s).map(row).sum();
            (vec![ParamValue::I32(BAND as i32), ParamValue::I32(GLOBALS as i32)], vec![], kept as f64 / pairs)
        }
        "sink-window" => {
            // The window, the sinks below it, and (for the first rows) the
            // sinks past the query: the sinks are not causal.
            let row = |q: usize| {
                (q + 1).min(WINDOW) + SINKS.min((q + 1).saturating_sub(WINDOW)) + SINKS.min(s).saturating_sub(q + 1)
            };
            let kept: usize = (0..s).map(row).sum();
            (vec![ParamValue::I32(SINKS as i32), ParamValue::I32(WINDOW as i32)], vec![], kept as f64 / pairs)
        }
        "prefix-lm" => {
            let kept: usize = (0..s).map(|q| (q + 1).max(PREFIX.min(s))).sum();
            (vec![ParamValue::I32(PREFIX as i32)], vec![], kept as f64 / pairs)
        }
        "doc" => {
            // DOCS sorted documents of pseudo-random lengths per sequence.
            let mut ids = Vec::with_capacity(batch * s);
            let mut kept = 0usize;
            for b in 0..batch {
                let mut cuts: Vec<usize> =
                    (1..DOCS).map(|i| (i * s / DOCS + (b * 7919 + i * 104729) % (s / 8)) % s).collect();
                cuts.sort_unstable();
                let row: Vec<i32> = (0..s).map(|i| cuts.iter().filter(|&&c| c <= i).count() as i32).collect();
                for doc in 0..DOCS as i32 {
                    let len = row.iter().filter(|&&d| d == doc).count();
                    kept += len * len;
                }
                ids.extend(row);
            }
            (vec![], vec![TensorData::I32(ids)], kept as f64 / (batch as f64 * pairs))
        }
        _ => (vec![], vec![], 1.0),
    }
}

/// `docs` document lengths summing to `tokens`, uneven (weights 100..2000
/// from a multiplicative hash) and the same in `bench/packed_peers.py`.
fn document_lengths(tokens: usize, docs: usize) -> Vec<usize> {
    let weights: Vec<usize> = (1..=docs).map(|i| 100 + (i * 2_654_435_761 % (1 << 32)) % 1900).collect();
    let total: usize = weights.iter().sum();
    let mut lens: Vec<usize> = weights.iter().map(|w| tokens * w / total).collect();
    lens[docs - 1] += tokens - lens.iter().sum::<usize>();
    lens
}

/// The `--packed` rows (see the module note) for each head dim; with
/// `--backward`, their training steps' rows too, in the suite's tiles.
fn packed_documents(rt: &Runtime, suite: &Suite, dims: &[Dims]) {
    println!("{:<16} {:>4} {:>6} {:>3} {:>10} {:>9} {:>8}", "variant", "d", "s", "b", "ms", "TFLOP/s", "density");
    for &d in dims {
        for docs in [8, 64] {
            let lens = document_lengths(TOKENS, docs);
            let kept: usize = lens.iter().map(|l| l * (l + 1) / 2).sum();
            let density = kept as f64 / (TOKENS * TOKENS) as f64;
            let print = |rows: &[(String, Timed)], b: usize, pairs: usize| {
                print_rows(
                    rows,
                    &format!("{d:>4} {TOKENS:>6} {b:>3}"),
                    d.flops_per_pair() * (HEADS * pairs) as f64,
                    density,
                )
            };
            let causal = |body: &str| {
                flashgen::parse_one(&format!("Packed {{ dtype: bf16, {}, {body} }}", d.fields())).expect("valid spec")
            };
            let spec = causal("mask: q >= k,");
            let pairs: Vec<(usize, usize)> = lens.iter().map(|&l| (l, l)).collect();
            let problem = verify::varlen::random_varlen_problem(&spec, (HEADS, HEADS), &pairs, vec![], docs as u64);
            print(&time_varlen(rt, suite, &spec, &problem, &format!("pack{docs}-varlen")), docs, kept);

            let spec = causal("tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] && q >= k,");
            let ids = lens.iter().enumerate().flat_map(|(i, &l)| std::iter::repeat_n(i as i32, l)).collect();
            let shape = Shape { batch: 1, heads: HEADS, heads_kv: HEADS, q_len: TOKENS, kv_len: TOKENS };
            let problem =
                verify::random_problem(&spec, shape, vec![], vec![Some(TensorData::I32(ids))], None, docs as u64);
            let name = format!("pack{docs}-doc");
            let rows = time_dense(rt, suite, &spec, &problem, &name, |gpu| {
                let (ms, kept) = time_block_mask(rt, gpu, &spec, &problem)?;
                println!("{name:<16} {d:>4} {TOKENS:>6} {:>3} {ms:>10.3} block-mask build ({kept} tiles)", 1);
                Ok(())
            });
            print(&rows, 1, kept);

            let s = TOKENS / docs;
            let shape = Shape { batch: docs, heads: HEADS, heads_kv: HEADS, q_len: s, kv_len: s };
            let spec = causal("mask: q >= k,");
            let problem = verify::random_problem(&spec, shape, vec![], vec![], None, docs as u64);
            let rows = time_dense(rt, suite, &spec, &problem, &format!("pack{docs}-even"), |_| Ok(()));
            print(&rows, docs, docs * s * (s + 1) / 2);
        }
    }
}

/// Times dense `problem`'s forward (row `name`) and, with `--backward`, its
/// training step in each of the suite's tiles, after `prepare` (a block
/// mask's build), L2 flushed.
fn time_dense(
    rt: &Runtime,
    suite: &Suite,
    spec: &flashgen::Spec,
    problem: &Problem,
    name: &str,
    prepare: impl FnOnce(&mut DeviceProblem) -> Result<(), flashgen::Error>,
) -> Vec<(String, Timed)> {
    let iters = suite.iters;
    let uploaded = DeviceProblem::upload(rt, spec, problem, OperandLayout::Bshd)
        .and_then(|mut gpu| gpu.flush_l2(L2_FLUSH_BYTES).and_then(|()| prepare(&mut gpu)).map(|()| gpu));
    let mut gpu = match uploaded {
        Ok(gpu) => gpu,
        Err(e) => return vec![(name.to_string(), Err(e))],
    };
    let steps = time_steps(rt, suite, spec, name, |tile| {
        gpu.pin_backward_tile(tile);
        gpu.time_forward_backward(rt, spec, problem, iters)
    });
    gpu.pin_backward_tile(None);
    let mut rows = vec![(name.to_string(), gpu.time(rt, spec, problem, iters))];
    rows.extend(steps);
    rows
}

#[cfg(test)]
mod tests {
    /// The lengths `bench/packed_peers.py` computes for the same batches.
    #[test]
    fn document_lengths_match_the_peers_script() {
        assert_eq!(super::document_lengths(32768, 8), [3397, 5748, 2075, 4426, 6777, 3104, 5455, 1786]);
        let lens = super::document_lengths(32768, 64);
        assert_eq!(lens[..8], [451, 764, 275, 588, 901, 412, 725, 236]);
        assert_eq!((lens.iter().sum::<usize>(), lens.iter().min(), lens.iter().max()), (32768, Some(&47), Some(&952)));
    }
}
