//! Every shipped spec's forward, block-mask and backward kernels compile with NVRTC for sm_80 and
//! sm_90, and compile errors come back readable. Needs libnvrtc but no GPU;
//! `scripts/test.sh` installs NVRTC from PyPI when it is missing.

mod support;

use flashgen_codegen::abi::{ArgKind, Kernel};
use flashgen_codegen::cuda::{
    emit_add_f32, emit_add_partial, emit_backward, emit_backward_varlen, emit_backward_with, emit_block_mask,
    emit_decode, emit_decode_paged, emit_decode_with, emit_e4m3_v_tiles, emit_forward_copying, emit_forward_dropout,
    emit_forward_e4m3, emit_forward_paged, emit_forward_varlen, emit_merge_partial, emit_paged_append, emit_work_order,
    BackwardConfig, BackwardPass, DecodeCache, DecodeConfig, DecodeQueries, KvCacheDtype, Mma, Target, TileCopy,
    WarpSplit, Work,
};
use flashgen_codegen::{parse_str, HeadDims, Spec};
use flashgen_runtime::tile_choice;
use flashgen_runtime::{compile_cubin, compile_cubin_with_log, compile_phases, kernel_resources, Arch, Error};
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use support::{raw_kernel, require_nvrtc};

fn shipped_specs() -> Vec<Spec> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "attn"))
        .collect();
    paths.sort();
    paths
        .iter()
        .flat_map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            parse_str(&text).unwrap_or_else(|e| panic!("{}", e.render(&p.display().to_string(), &text)))
        })
        .collect()
}

#[test]
fn every_shipped_spec_compiles_for_sm80_and_sm90() {
    require_nvrtc();
    let specs = shipped_specs();
    assert!(specs.len() >= 10, "expected the specs/ examples, found {}", specs.len());
    compile_all(specs.iter().flat_map(every_kernel).collect());
}

/// The language's features no shipped spec uses (the i32 bit operators,
/// Euclidean builtins, dimension expressions), in every kernel, like a
/// shipped spec's.
#[test]
fn language_feature_specs_compile_for_sm80_and_sm90() {
    compile_spec_file("language.attn", include_str!("../../codegen/tests/specs/language.attn"));
}

/// Specs drawn by the spec generator that once failed to compile or hung
/// NVVM (`codegen/tests/specs/regressions.attn`): every kernel, both arches.
#[test]
fn drawn_regression_specs_compile_for_sm80_and_sm90() {
    compile_spec_file("regressions.attn", include_str!("../../codegen/tests/specs/regressions.attn"));
}

/// Every kernel of every spec in `source` (the file `name`), both arches.
fn compile_spec_file(name: &str, source: &str) {
    require_nvrtc();
    let specs = parse_str(source).unwrap_or_else(|e| panic!("{}", e.render(name, source)));
    compile_all(specs.iter().flat_map(every_kernel).collect());
}

/// Head dims whose Hopper forward is the warp-specialized one above d = 128
/// (and d = 80 and 96, padded to 128 columns): every wgmma candidate in both
/// copy paths, and the four backward kernels, compile for sm_90
/// unserialized; the preferred kernel is warp-specialized. Plain and causal
/// at every dim; ALiBi, softcap and a window too at 192 / 128 and 256.
/// With them the Hopper dK/dV kernel where it covers the dims (80 and 96
/// whole columns, 160 through 256 column halves and transposed tiles),
/// copying either way, and
/// the row kernels that zero and read its dQ accumulator.
#[test]
fn wide_head_dims_compile_for_sm90() {
    require_nvrtc();
    let hopper = Arch::new(9, 0);
    let bodies = [
        "",
        "mask: q >= k,",
        "tensor slopes: f32[H], mask: q >= k, score: score + slopes[h] * (k - q) as f32,",
        "param cap: f32, mask: q >= k, score: cap * tanh(score / cap),",
        "param w: i32, mask: q >= k && q - k < w,",
    ];
    let dims = [(80, 80), (96, 96), (160, 160), (192, 192), (192, 128), (224, 224), (256, 256)];
    let mut jobs = Vec::new();
    for (qk, v) in dims {
        let every_body = qk == 256 || v < qk;
        for body in bodies.iter().take(if every_body { bodies.len() } else { 2 }) {
            let source = format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v}, {body} }}");
            let spec = parse_str(&source).unwrap().remove(0);
            let candidates = tile_choice::candidates(&spec, hopper.target());
            assert!(candidates[0].persistent(), "{source}: {:?}", candidates[0]);
            for c in candidates.into_iter().filter(|c| c.mma == Mma::Wgmma) {
                let copies = if c.persistent() { &[TileCopy::Tma, TileCopy::Threads][..] } else { &[TileCopy::Tma] };
                jobs.extend(copies.iter().map(|&copy| (emit_forward_copying(&spec, c, copy), hopper)));
            }
            if body.is_empty() {
                let passes =
                    [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Query, BackwardPass::Postprocess];
                jobs.extend(passes.map(|pass| (emit_backward(&spec, pass), hopper)));
            }
            let preferred = BackwardConfig::preferred(&spec, hopper.target());
            if body.is_empty() {
                let rows = [BackwardPass::Preprocess, BackwardPass::Postprocess];
                jobs.extend(rows.map(|pass| (emit_backward_with(&spec, pass, preferred.for_pass(pass)), hopper)));
            }
            for tile in BackwardConfig::tiles(&spec, hopper.target()).into_iter().filter(|t| t.mma == Mma::Wgmma) {
                for copy in [TileCopy::Tma, TileCopy::Threads] {
                    let config = BackwardConfig { copy, ..preferred.with_tile(tile) };
                    jobs.push((emit_backward_with(&spec, BackwardPass::KeyValue, config), hopper));
                }
            }
        }
    }
    compile_all(jobs);
}

/// Every kernel the runtime may compile for `spec`, with its arch.
fn every_kernel(spec: &Spec) -> Vec<(Kernel, Arch)> {
    let block_mask = emit_block_mask(spec);
    // Work orders: the dK/dV kernel's, and every persistent forward's items'.
    let block_n = BackwardConfig::preferred(spec, Arch::new(9, 0).target()).block_n(spec);
    let items = tile_choice::candidates(spec, Arch::new(9, 0).target()).into_iter().filter(|c| c.persistent());
    let orders: Vec<Option<Kernel>> = [Work::KeyTiles { block_n }]
        .into_iter()
        .chain(items.map(|c| Work::QueryTiles { block_m: c.block_m() }))
        .map(|work| emit_work_order(spec, work))
        .collect();
    let backward = [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Query, BackwardPass::Postprocess]
        .map(|pass| Some(emit_backward(spec, pass)));
    let shared = [block_mask].into_iter().chain(orders).chain(backward).flatten();
    let both = shared.flat_map(|kernel| [Arch::new(8, 0), Arch::new(9, 0)].map(|arch| (kernel.clone(), arch)));
    // Every forward configuration the runtime may pick (or tune) on each arch;
    // the portable ones once, on sm_80; the warp-specialized ones copying
    // either way.
    let sm80 = tile_choice::candidates(spec, Target::PORTABLE)
        .into_iter()
        .map(|c| (emit_forward_copying(spec, c, TileCopy::Threads), Arch::new(8, 0)));
    let hopper = tile_choice::candidates(spec, Arch::new(9, 0).target())
        .into_iter()
        .filter(|c| c.mma == Mma::Wgmma)
        .flat_map(|c| {
            let copies = if c.persistent() { &[TileCopy::Tma, TileCopy::Threads][..] } else { &[TileCopy::Tma] };
            copies.iter().map(move |&copy| (emit_forward_copying(spec, c, copy), Arch::new(9, 0)))
        });
    let forward = sm80.chain(hopper);
    // The Hopper dK/dV kernel, where the spec's head dims have one, with
    // and without tensor gradients, and the postprocess of its dQ
    // accumulator.
    let bwd_config = BackwardConfig::preferred(spec, Arch::new(9, 0).target());
    let passes = [
        (BackwardPass::KeyValue, true, TileCopy::Tma),
        (BackwardPass::KeyValue, false, TileCopy::Tma),
        (BackwardPass::KeyValue, true, TileCopy::Threads),
        (BackwardPass::Postprocess, true, TileCopy::Tma),
    ];
    let hopper_bwd = passes.into_iter().filter(|_| bwd_config.mma == Mma::Wgmma).map(|(pass, tensor_grads, copy)| {
        let config = BackwardConfig { tensor_grads, copy, ..bwd_config };
        (emit_backward_with(spec, pass, config), Arch::new(9, 0))
    });
    both.chain(forward).chain(hopper_bwd).collect::<Vec<_>>()
}

/// Every shipped spec's varlen forward, in every configuration the runtime
/// may pick on sm_80 and sm_90 (the persistent ones copy with threads).
#[test]
fn every_shipped_spec_compiles_varlen_for_sm80_and_sm90() {
    require_nvrtc();
    let jobs: Vec<(Kernel, Arch)> = shipped_specs().iter().flat_map(varlen_kernels).collect();
    assert!(jobs.iter().any(|(k, _)| k.source.contains("claim(work_counter, done + 1, items)")));
    compile_all(jobs);
}

fn varlen_kernels(spec: &Spec) -> Vec<(Kernel, Arch)> {
    let sm80 = tile_choice::candidates(spec, Target::PORTABLE).into_iter().map(|c| (c, Arch::new(8, 0)));
    let hopper = tile_choice::candidates(spec, Arch::new(9, 0).target())
        .into_iter()
        .filter(|c| c.mma == Mma::Wgmma)
        .map(|c| (c, Arch::new(9, 0)));
    let copies = [TileCopy::Tma, TileCopy::Threads];
    sm80.chain(hopper)
        .flat_map(|(c, arch)| copies.map(|copy| (emit_forward_varlen(spec, c, c.kernel_copy(copy)), arch)))
        .collect()
}

/// Every shipped spec's paged forward on sm_80 (its preferred configuration)
/// and sm_90 (every wgmma candidate, the persistent ones copying with TMA
/// and with threads), and its paged append.
#[test]
fn every_shipped_spec_compiles_paged_for_sm80_and_sm90() {
    require_nvrtc();
    let jobs: Vec<(Kernel, Arch)> = shipped_specs().iter().flat_map(paged_kernels).collect();
    assert!(jobs.iter().any(|(k, _)| k.source.contains("load_paged_tile<BLOCK_N")));
    assert!(jobs.iter().any(|(k, _)| k.source.contains("load_paged_boxes<BLOCK_N")));
    compile_all(jobs);
}

fn paged_kernels(spec: &Spec) -> Vec<(Kernel, Arch)> {
    let sm80 = [(tile_choice::preferred(spec, Target::PORTABLE), Arch::new(8, 0))];
    let hopper = tile_choice::candidates(spec, Arch::new(9, 0).target())
        .into_iter()
        .filter(|c| c.mma == Mma::Wgmma)
        .map(|c| (c, Arch::new(9, 0)));
    let append = [(emit_paged_append(spec), Arch::new(8, 0))];
    let copies = [TileCopy::Tma, TileCopy::Threads];
    let forward = sm80
        .into_iter()
        .chain(hopper)
        .flat_map(move |(c, arch)| copies.map(|copy| (emit_forward_paged(spec, c, c.kernel_copy(copy)), arch)));
    forward.chain(append).collect()
}

/// Every shipped spec's decode kernels (one and two 16-row tiles, each
/// target's stages) and its combine kernel compile for sm_80 and sm_90, and
/// so do head dims 64 and 256 and the language's other features.
#[test]
fn every_shipped_spec_compiles_decode_for_sm80_and_sm90() {
    require_nvrtc();
    let mut specs = shipped_specs();
    specs.extend(parse_str(include_str!("../../codegen/tests/specs/language.attn")).unwrap());
    specs.extend(
        ["D64 { dtype: f16, head_dim: 64, mask: q >= k }", "D256 { dtype: bf16, head_dim: 256 }"]
            .map(|text| parse_str(text).unwrap().remove(0)),
    );
    compile_all(specs.iter().flat_map(decode_kernels).collect());
}

fn decode_kernels(spec: &Spec) -> Vec<(Kernel, Arch)> {
    [(Target::PORTABLE, Arch::new(8, 0)), (Arch::new(9, 0).target(), Arch::new(9, 0))]
        .into_iter()
        .flat_map(|(target, arch)| {
            [4, 32].map(|rows| (emit_decode(spec, DecodeConfig::for_rows(spec, target, rows).unwrap()), arch))
        })
        .collect()
}

/// Every shipped spec's decode kernels over packed (varlen) queries, on a
/// dense and a paged cache (one and two 16-row tiles), compile for sm_80
/// and sm_90, and so do the language's other features.
#[test]
fn every_shipped_spec_compiles_varlen_decode_for_sm80_and_sm90() {
    require_nvrtc();
    let mut specs = shipped_specs();
    specs.extend(parse_str(include_str!("../../codegen/tests/specs/language.attn")).unwrap());
    compile_all(specs.iter().flat_map(varlen_decode_kernels).collect());
}

fn varlen_decode_kernels(spec: &Spec) -> Vec<(Kernel, Arch)> {
    let mut jobs = Vec::new();
    for (target, arch) in [(Target::PORTABLE, Arch::new(8, 0)), (Arch::new(9, 0).target(), Arch::new(9, 0))] {
        for (rows, cache) in [(4, DecodeCache::Dense), (32, DecodeCache::Dense), (32, DecodeCache::Paged)] {
            let config = DecodeConfig::for_rows(spec, target, rows).unwrap();
            jobs.push((emit_decode_with(spec, config, cache, DecodeQueries::Packed), arch));
        }
    }
    jobs
}

/// Every shipped spec's decode kernels over e4m3 caches (dense, paged, and
/// packed queries on both; one and two 16-row tiles) compile for sm_80 (no
/// e4m3 conversion instruction) and sm_90, at both dtypes and at head dims
/// that are not a multiple of 16, and so do the language's other features.
#[test]
fn every_shipped_spec_compiles_e4m3_decode_for_sm80_and_sm90() {
    require_nvrtc();
    let mut specs = shipped_specs();
    specs.extend(parse_str(include_str!("../../codegen/tests/specs/language.attn")).unwrap());
    specs.extend(
        ["F16 { dtype: f16, head_dim: 64, mask: q >= k }", "Odd { dtype: bf16, head_dim: 72, v_head_dim: 40 }"]
            .map(|text| parse_str(text).unwrap().remove(0)),
    );
    compile_all(specs.iter().flat_map(e4m3_decode_kernels).collect());
}

/// Every shipped spec's e4m3 forward (and its V-tile kernel) compiles for
/// sm_90a unserialized in its configuration, and the language fixture's
/// in every candidate configuration at d = 64 and 96.
#[test]
fn every_shipped_spec_compiles_its_e4m3_forward_for_sm90() {
    require_nvrtc();
    let sm90 = Arch::new(9, 0);
    let language = parse_str(include_str!("../../codegen/tests/specs/language.attn")).unwrap().remove(0);
    let narrow = [64, 96].map(|d| Spec { head_dims: HeadDims { qk: d, v: d }, ..language.clone() });
    let shipped = shipped_specs().into_iter().map(|spec| (tile_choice::e4m3(&spec, sm90.target()), spec));
    let fixture =
        narrow.into_iter().flat_map(|spec| tile_choice::e4m3_candidates(&spec).map(|c| (Some(c), spec.clone())));
    let mut jobs = Vec::new();
    for (config, spec) in shipped.chain(fixture) {
        let config = config.unwrap_or_else(|| panic!("{}: no e4m3 configuration", spec.name));
        let kernel = emit_forward_e4m3(&spec, config).unwrap_or_else(|| panic!("{}: {config:?}", spec.name));
        jobs.extend([(kernel, sm90), (emit_e4m3_v_tiles(&spec, config.block_n), sm90)]);
    }
    compile_all(jobs);
}

fn e4m3_decode_kernels(spec: &Spec) -> Vec<(Kernel, Arch)> {
    let mut jobs = Vec::new();
    for (target, arch) in [(Target::PORTABLE, Arch::new(8, 0)), (Arch::new(9, 0).target(), Arch::new(9, 0))] {
        for (rows, cache, queries) in [
            (4, DecodeCache::Dense, DecodeQueries::Padded),
            (32, DecodeCache::Paged, DecodeQueries::Padded),
            (32, DecodeCache::Dense, DecodeQueries::Packed),
            (4, DecodeCache::Paged, DecodeQueries::Packed),
        ] {
            let config = DecodeConfig::for_cache(spec, target, rows, KvCacheDtype::E4m3).unwrap();
            jobs.push((emit_decode_with(spec, config, cache, queries), arch));
        }
    }
    jobs
}

/// Context parallelism's partials kernels (merge, add, flat add) compile
/// for sm_80 and sm_90a at both dtypes, at a V head dim below a warp's
/// width, one that is not a multiple of it, and the usual 128.
#[test]
fn partials_kernels_compile_for_sm80_and_sm90() {
    require_nvrtc();
    let specs = [
        "P16 { dtype: f16, head_dim: 16 }",
        "P59 { dtype: f16, head_dim: 59 }",
        "P128 { dtype: bf16, head_dim: 192, v_head_dim: 128 }",
    ];
    let jobs = specs.iter().flat_map(|text| {
        let spec = parse_str(text).unwrap().remove(0);
        let kernels = [emit_merge_partial(&spec), emit_add_partial(&spec), emit_add_f32(&spec)];
        kernels.into_iter().flat_map(|k| [Arch::new(8, 0), Arch::new(9, 0)].map(|arch| (k.clone(), arch)))
    });
    compile_all(jobs.collect());
}

/// Every shipped spec's paged decode kernel (one and two 16-row tiles) at
/// head dims 64, 128 and 256 compiles for sm_80 and sm_90, and so do the
/// language's other features.
#[test]
fn every_shipped_spec_compiles_paged_decode_for_sm80_and_sm90() {
    require_nvrtc();
    let mut specs: Vec<Spec> = shipped_specs()
        .into_iter()
        .flat_map(|spec| {
            [64, 128, 256].map(|d| Spec { head_dims: flashgen_codegen::HeadDims { qk: d, v: d }, ..spec.clone() })
        })
        .collect();
    specs.extend(parse_str(include_str!("../../codegen/tests/specs/language.attn")).unwrap());
    let jobs: Vec<(Kernel, Arch)> = specs
        .iter()
        .flat_map(|spec| {
            [(Target::PORTABLE, Arch::new(8, 0)), (Arch::new(9, 0).target(), Arch::new(9, 0))].into_iter().flat_map(
                move |(target, arch)| {
                    let rows = if spec.head_dims.qk == 128 { vec![4, 32] } else { vec![32] };
                    rows.into_iter().map(move |rows| {
                        (emit_decode_paged(spec, DecodeConfig::for_rows(spec, target, rows).unwrap()), arch)
                    })
                },
            )
        })
        .collect();
    compile_all(jobs);
}

/// Every shipped spec's varlen backward kernels: the portable ones for sm_80
/// and sm_90, and on sm_90 the configuration the runtime prefers there
/// (the Hopper dK/dV kernel and its accumulator's row kernels, where the
/// head dims have it), with and without tensor gradients.
#[test]
fn every_shipped_spec_compiles_varlen_backward_for_sm80_and_sm90() {
    require_nvrtc();
    compile_all(shipped_specs().iter().flat_map(varlen_backward_kernels).collect());
}

fn varlen_backward_kernels(spec: &Spec) -> Vec<(Kernel, Arch)> {
    const PASSES: [BackwardPass; 4] =
        [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Query, BackwardPass::Postprocess];
    let portable = BackwardConfig::default_for(spec);
    let hopper = BackwardConfig::preferred(spec, Arch::new(9, 0).target());
    let configs = [
        (portable, Arch::new(8, 0)),
        (BackwardConfig { tensor_grads: false, ..portable }, Arch::new(8, 0)),
        (hopper, Arch::new(9, 0)),
        (BackwardConfig { tensor_grads: false, ..hopper }, Arch::new(9, 0)),
        (BackwardConfig { copy: TileCopy::Threads, ..hopper }, Arch::new(9, 0)),
    ];
    let kernels = configs
        .into_iter()
        .flat_map(|(config, arch)| PASSES.map(|pass| (emit_backward_varlen(spec, pass, config.for_pass(pass)), arch)));
    // A pass that reads neither tensor_grads nor the MMA repeats a kernel.
    let mut seen = HashSet::new();
    kernels.filter(|(kernel, arch)| seen.insert(format!("{arch} {}", kernel.source))).collect()
}

/// A spec's kernels of one kind, each with the arch it compiles for.
type KernelsOf = fn(&Spec) -> Vec<(Kernel, Arch)>;

/// Specs with learned sinks beyond the shipped one: a sink on a key-linear
/// bias whose row part the forward leaves out of its logits (d = 64), and a
/// sink reading a tensor the score reads too, through a `KV_LEN` dim (which
/// the backward preprocess then sizes), with an i32 helper only the sink
/// uses; every kernel kind of each compiles.
#[test]
fn sink_specs_compile_every_kernel() {
    require_nvrtc();
    let source = "
        SinkAlibi {
            dtype: f16, head_dim: 64,
            tensor slopes: f32[H],
            tensor sinks: f32[H],
            mask: q >= k,
            score: score + slopes[h] * (k - q) as f32,
            sink: 2.0 * tanh(sinks[h]),
        }
        SharedSink {
            dtype: bf16, head_dim: 128,
            param p: f32,
            tensor w: f32[H, KV_LEN],
            tensor ids: i32[B, KV_LEN],
            mask: ids[b][q] == ids[b][k],
            score: score * w[h][0],
            sink: w[h][1] * p + rem_euclid(b - h, 3) as f32,
        }";
    let mut specs = parse_str(source).unwrap_or_else(|e| panic!("{}", e.render("sinks", source)));
    specs.extend(shipped_specs().into_iter().filter(|s| s.sink.is_some()));
    assert_eq!(specs.len(), 3, "the shipped sink spec is among the examples");
    let kinds: [KernelsOf; 6] =
        [every_kernel, varlen_kernels, paged_kernels, decode_kernels, varlen_decode_kernels, varlen_backward_kernels];
    let jobs: Vec<(Kernel, Arch)> =
        specs.iter().flat_map(|spec| kinds.iter().flat_map(move |kind| kind(spec))).collect();
    assert!(jobs.iter().any(|(k, _)| k.source.contains("atomicAdd(&dt_sinks[")), "the preprocess trains the sinks");
    compile_all(jobs);
}

/// Every shipped spec's shard view (context parallelism: positions and
/// lengths as params, tensors' dims the whole sequence's) compiles the
/// Hopper kernels a rank's pieces run: the preferred forward, copying by
/// TMA, the backward's kernels, and a data-dependent mask's block mask.
#[test]
fn every_shipped_spec_compiles_its_shard_view_for_sm90() {
    require_nvrtc();
    let hopper = Arch::new(9, 0);
    let jobs = shipped_specs().into_iter().flat_map(|spec| {
        let view = flashgen_codegen::shard::view(&spec, true);
        let forward = emit_forward_copying(&view, tile_choice::preferred(&view, hopper.target()), TileCopy::Tma);
        let passes = [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Postprocess];
        let config = BackwardConfig::preferred(&view, hopper.target());
        let backward: Vec<Kernel> = passes.iter().map(|&pass| emit_backward_with(&view, pass, config)).collect();
        // A data-dependent mask's pieces build block masks of their own.
        let block_mask = view.mask.as_ref().filter(|m| m.reads_tensor()).and_then(|_| emit_block_mask(&view));
        std::iter::once(forward).chain(backward).chain(block_mask).map(move |k| (k, hopper))
    });
    compile_all(jobs.collect());
}

/// Dropout's kernels (`emit_forward_dropout`, the dK/dV and dQ kernels of a
/// dropout backward) compile for the specs its GPU tests run: a causal
/// mask, a window, a softcap and a spec with tensors, at d = 64 and 128:
/// the forward in every configuration the runtime may pick on sm_80 and
/// sm_90 (copying either way), the backward's portable and Hopper kernels;
/// and every shipped spec's on sm_90.
#[test]
fn dropout_kernels_compile_for_sm80_and_sm90() {
    require_nvrtc();
    let source = "
        DropCausal { dtype: bf16, head_dim: 128, mask: q >= k }
        DropWindow { dtype: f16, head_dim: 64, param w: i32, mask: q >= k && q - k < w }
        DropSoftcap { dtype: bf16, head_dim: 64, param cap: f32, mask: q >= k, score: cap * tanh(score / cap) }
        DropTensors {
            dtype: f16, head_dim: 128,
            tensor slopes: f32[H], tensor doc: i32[B, KV_LEN],
            mask: doc[b][q] == doc[b][k],
            score: score + slopes[h] * (k - q) as f32,
        }";
    let specs = parse_str(source).unwrap_or_else(|e| panic!("{}", e.render("dropout", source)));
    let (sm80, sm90) = (Arch::new(8, 0), Arch::new(9, 0));
    let mut jobs = Vec::new();
    for spec in &specs {
        for c in tile_choice::candidates(spec, Target::PORTABLE) {
            jobs.push((emit_forward_dropout(spec, c, TileCopy::Threads), sm80));
        }
        for c in tile_choice::candidates(spec, sm90.target()).into_iter().filter(|c| c.mma == Mma::Wgmma) {
            let copies = if c.persistent() { &[TileCopy::Tma, TileCopy::Threads][..] } else { &[TileCopy::Tma] };
            jobs.extend(copies.iter().map(|&copy| (emit_forward_dropout(spec, c, copy), sm90)));
        }
        for (config, arch) in
            [(BackwardConfig::default_for(spec), sm80), (BackwardConfig::preferred(spec, sm90.target()), sm90)]
        {
            let config = BackwardConfig { dropout: true, ..config };
            for pass in [BackwardPass::KeyValue, BackwardPass::Query] {
                jobs.push((emit_backward_with(spec, pass, config.for_pass(pass)), arch));
            }
        }
    }
    // Every shipped spec: the preferred forward and the dropout backward's
    // kernels on sm_90.
    for spec in &shipped_specs() {
        let forward = tile_choice::preferred(spec, sm90.target());
        jobs.push((emit_forward_dropout(spec, forward, TileCopy::Tma), sm90));
        let config = BackwardConfig { dropout: true, ..BackwardConfig::preferred(spec, sm90.target()) };
        for pass in [BackwardPass::KeyValue, BackwardPass::Query] {
            jobs.push((emit_backward_with(spec, pass, config.for_pass(pass)), sm90));
        }
    }
    assert!(jobs.iter().all(|(k, _)| k.name.contains("dropout") && k.source.contains("philox4x32_10")));
    compile_all(jobs);
}

/// Compiles `jobs` on every core (NVRTC takes seconds per kernel).
fn compile_all(jobs: Vec<(Kernel, Arch)>) {
    in_parallel(&jobs, |kernel, arch| {
        let (cubin, log) =
            compile_cubin_with_log(kernel, arch).unwrap_or_else(|e| panic!("{} for {arch}: {e}", kernel.name));
        assert!(cubin.starts_with(b"\x7fELF"), "{} for {arch}: not an ELF CUBIN", kernel.name);
        // ptxas runs every wgmma of a kernel serially when it cannot
        // prove their pipeline safe (C7514, C7519, ...): correct, but
        // it cost the Hopper kernel a third of its speed.
        assert!(!log.contains("serialized"), "{} for {arch}: {log}", kernel.name);
        // The front end's warnings name dead code in the emitted source (a
        // local nothing reads) or a read it cannot prove follows a write.
        assert!(!log.contains(": warning #"), "{} for {arch}: {log}", kernel.name);
    });
}

/// Runs `check` on every job, on as many threads as there are cores.
fn in_parallel(jobs: &[(Kernel, Arch)], check: impl Fn(&Kernel, Arch) + Sync) {
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some((kernel, arch)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    check(kernel, *arch);
                }
            });
        }
    });
}

/// MLA's absorbed decode (QK 576 / V 512: warps split O's columns) compiles
/// for sm_80 and sm_90 without local memory: V read from K's tiles or from
/// a tensor of its own, dense and paged caches, padded and packed queries,
/// one and two 16-row tiles (16 and 128 query heads), f16 and bf16, plain
/// and bottom-right causal; and so does V read from K's tiles at d = 128,
/// where the warps split the keys. A split launch runs the same kernel (the
/// split count is an argument).
#[test]
fn mla_decode_compiles_without_spills_for_sm80_and_sm90() {
    require_nvrtc();
    let specs = parse_str(
        "MlaCausal { dtype: bf16, head_dim: 576, v_head_dim: 512, mask: q + kv_len - q_len >= k }\n\
         Mla { dtype: f16, head_dim: 576, v_head_dim: 512 }",
    )
    .unwrap();
    let (dense, paged) = (DecodeCache::Dense, DecodeCache::Paged);
    let (padded, packed) = (DecodeQueries::Padded, DecodeQueries::Packed);
    let mut jobs = Vec::new();
    for spec in &specs {
        for (target, arch) in [(Target::PORTABLE, Arch::new(8, 0)), (Arch::new(9, 0).target(), Arch::new(9, 0))] {
            for (rows, v_in_k, cache, queries) in [
                (16, true, dense, padded),
                (128, true, dense, padded),
                (128, true, paged, padded),
                (64, true, dense, packed),
                (16, true, paged, packed),
                (16, false, dense, padded),
                (128, false, paged, padded),
            ] {
                let config = DecodeConfig::choose(spec, target, rows, KvCacheDtype::Spec, v_in_k).unwrap();
                assert_eq!(config.warps, WarpSplit::Columns);
                jobs.push((emit_decode_with(spec, config, cache, queries), arch));
            }
        }
    }
    // V read from K's tiles where warps split the keys (V = K at d = 128).
    let shared = parse_str("VisK { dtype: bf16, head_dim: 128, mask: q >= k }").unwrap().remove(0);
    for (target, arch) in [(Target::PORTABLE, Arch::new(8, 0)), (Arch::new(9, 0).target(), Arch::new(9, 0))] {
        let config = DecodeConfig::choose(&shared, target, 32, KvCacheDtype::Spec, true).unwrap();
        assert_eq!(config.warps, WarpSplit::Keys);
        jobs.extend([dense, paged].map(|cache| (emit_decode_with(&shared, config, cache, padded), arch)));
    }
    in_parallel(&jobs, |kernel, arch| {
        let used = kernel_resources(kernel, arch).unwrap_or_else(|e| panic!("{} for {arch}: {e}", kernel.name));
        eprintln!("{} for {arch}: {used:?}", kernel.name);
        assert!(used.registers > 0, "{} for {arch}: no ptxas report", kernel.name);
        let local = (used.stack_frame, used.spill_stores, used.spill_loads);
        assert_eq!(local, (0, 0, 0), "{} for {arch} uses local memory", kernel.name);
    });
}

#[test]
fn compile_errors_carry_the_log_and_numbered_source() {
    require_nvrtc();
    let kernel =
        raw_kernel("broken", "extern \"C\" __global__ void broken(float* o) {\n    o[0] = undeclared_value;\n}\n");
    match compile_cubin(&kernel, Arch::new(8, 0)) {
        Err(Error::Compile { kernel, arch, log, numbered_source }) => {
            assert_eq!((kernel.as_str(), arch), ("broken", Arch::new(8, 0)));
            assert!(log.contains("broken.cu(2)") && log.contains("undeclared_value"), "{log}");
            assert!(numbered_source.contains("2 |     o[0] = undeclared_value;"), "{numbered_source}");
        }
        other => panic!("expected Error::Compile, got {other:?}"),
    }
}

/// NVRTC's `--time` report reads back: every phase ran and took some time.
#[test]
fn compile_phases_reads_nvrtcs_report() {
    require_nvrtc();
    let kernel = raw_kernel("timed", "extern \"C\" __global__ void timed(float* o) { o[threadIdx.x] = 1.0f; }\n");
    let phases = compile_phases(&kernel, Arch::new(9, 0)).expect("compiles").expect("a report");
    assert!(phases.front_end_ms > 0.0 && phases.optimizer_ms >= 0.0 && phases.ptxas_ms >= 0.0, "{phases:?}");
}

/// The Hopper dK/dV kernel in 80-query steps (d = 128, dQ transposed) and
/// its postprocess compile for sm_90, dense and varlen, copying with TMA
/// and with threads, with and without tensor gradients, under full, causal,
/// windowed and tensor-reading masks at d = 128 and 120; without a mask its
/// consumers hold dK, dV, Sᵀ, dPᵀ and dQᵀ in registers with no local memory
/// (ptxas would otherwise serialize every wgmma of the kernel).
#[test]
fn transposed_dq_steps_compile_for_sm90() {
    require_nvrtc();
    let specs = parse_str(
        "Full { dtype: bf16, head_dim: 128 }\n\
         Causal { dtype: f16, head_dim: 128, mask: q >= k }\n\
         Window { dtype: bf16, head_dim: 128, mask: q >= k && q - k < 1024 }\n\
         Document { dtype: bf16, head_dim: 120, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
    )
    .unwrap();
    let sm90 = Arch::new(9, 0);
    let mut jobs = Vec::new();
    for spec in &specs {
        let tiles = BackwardConfig::tiles(spec, sm90.target());
        let tile = tiles.into_iter().find(|t| t.mma == Mma::Wgmma && t.block_m == 80);
        let tile = tile.unwrap_or_else(|| panic!("{} has a tile of 80-query steps", spec.name));
        let config = BackwardConfig::preferred(spec, sm90.target()).with_tile(tile);
        for (tensor_grads, copy) in [(true, TileCopy::Tma), (false, TileCopy::Tma), (true, TileCopy::Threads)] {
            let config = BackwardConfig { tensor_grads, copy, ..config };
            jobs.push((emit_backward_with(spec, BackwardPass::KeyValue, config), sm90));
            jobs.push((emit_backward_varlen(spec, BackwardPass::KeyValue, config), sm90));
        }
        let post = config.for_pass(BackwardPass::Postprocess);
        jobs.extend(
            [emit_backward_with, emit_backward_varlen].map(|emit| (emit(spec, BackwardPass::Postprocess, post), sm90)),
        );
    }
    assert!(jobs.iter().all(|(kernel, _)| kernel.block_m != 64 || kernel.name.contains("post")));
    in_parallel(&jobs, |kernel, arch| {
        let used = kernel_resources(kernel, arch).unwrap_or_else(|e| panic!("{} for {arch}: {e}", kernel.name));
        let unmasked =
            kernel.name == "flashgen_bwd_full" && kernel.args.iter().any(|a| matches!(a.kind, ArgKind::TensorMap(_)));
        if unmasked {
            let local = (used.stack_frame, used.spill_stores, used.spill_loads);
            assert_eq!(local, (0, 0, 0), "{} for {arch} uses local memory", kernel.name);
        }
    });
}
