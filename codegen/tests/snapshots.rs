//! Snapshots of the generated kernels: one per named variant in
//! `specs/`, plus edge specs that stress what the named ones don't (odd and
//! maximal head dims, f16, half-precision tensors, every operator).
//!
//! After an intended change to generated code, bless the new output with
//! `INSTA_UPDATE=always cargo test -p flashgen-codegen --test snapshots`
//! (or `cargo insta review`) and read the diff: it shows only what each
//! variant generates, since library parts appear by name.

use flashgen_codegen::abi::{ArgKind, DropoutArg, Kernel};
use flashgen_codegen::cuda::library::Part;
use flashgen_codegen::cuda::{
    e4m3_supports, emit_add_f32, emit_add_partial, emit_backward, emit_backward_varlen, emit_backward_with,
    emit_decode, emit_decode_paged, emit_decode_with, emit_e4m3_v_tiles, emit_forward, emit_forward_copying,
    emit_forward_dropout, emit_forward_e4m3, emit_forward_paged, emit_forward_varlen, emit_forward_with,
    emit_merge_partial, emit_paged_append, BackwardConfig, BackwardPass, DecodeCache, DecodeConfig, DecodeQueries,
    DqAccum, DqOrder, KeyColumns, KvCacheDtype, Mma, Target, TileConfig, TileCopy, TALL_PAIR,
};
use flashgen_codegen::{parse_one, Spec};
use std::path::PathBuf;

/// The `.attn` stems of `specs/`, sorted.
const VARIANTS: [&str; 14] = [
    "alibi",
    "block_sparse",
    "causal",
    "causal_bottom_right",
    "document",
    "full",
    "gqa",
    "longformer",
    "prefix_lm",
    "relative_bias",
    "sink_window",
    "sliding_window",
    "softcap",
    "streaming_window",
];

/// The Hopper tile configurations the snapshots pin: two or three consumer
/// warpgroups of 64 rows, or one per CTA and two CTAs per SM; 128-key tiles.
const TWO_WARPGROUPS: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };
const THREE_WARPGROUPS: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 12, m_tiles: 1, block_n: 128 };
const ONE_WARPGROUP_PAIR: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 4, m_tiles: 1, block_n: 128 };

/// Specs the named variants leave untested.
const EDGE_SPECS: [(&str, &str); 4] = [
    ("edge_odd_dims", "OddDims { dtype: f16, head_dim: 59, v_head_dim: 59, mask: k <= q }"),
    ("edge_max_dims", "MaxDims { dtype: bf16, head_dim: 256, param bias: f32, score: score + bias }"),
    (
        "edge_sink_alibi",
        "SinkAlibi { dtype: f16, head_dim: 64, tensor slopes: f32[H], tensor sinks: f32[H], mask: q >= k, \
         score: score + slopes[h] * (k - q) as f32, sink: 2.0 * tanh(sinks[h]) }",
    ),
    (
        "edge_every_operator",
        "/// Every operator, function and tensor element type once.
        EveryOperator {
            dtype: f16, head_dim: 96, v_head_dim: 64,
            param period: i32,
            param temp: f32,
            tensor lo: f16[H, 4],
            tensor hi: bf16[2, KV_LEN],
            tensor ids: i32[B, H_KV, Q_LEN],
            mask: (q / period) % 2 == k % period || !(q - k * 3 > -2147483647 - 1) && ids[b][h][q] != 0,
            score: if q >= k { min(score, temp) + max(abs(score), exp(score) % 2.5) }
                   else { clamp(exp2(lo[h][k % 4]), log(hi[1][k]), log2(sqrt(temp))) }
                   + tanh(sigmoid(floor(score))) + (clamp(abs(q - k), 0, 8) as f32) + ((score as i32) as f32)
                   - (max(min(-q, k), 1) as f32) / 30,
        }",
    ),
];

fn variant(stem: &str) -> Spec {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "specs", &format!("{stem}.attn")].iter().collect();
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse_one(&source).unwrap_or_else(|e| panic!("{stem}: {}", e.render(&path.display().to_string(), &source)))
}

/// The launch description, then the source with each CUDA library part it
/// includes named instead of repeated: the `.cuh` files pin the library
/// once, and a snapshot shows what the variant itself generates.
fn render(kernel: &Kernel) -> String {
    let source = Part::ALL.iter().fold(kernel.source.clone(), |source, part| {
        source.replacen(part.text(), &format!("// [library part: {}]\n", part.file_name()), 1)
    });
    let args: Vec<String> = kernel.args.iter().map(|a| format!("//   {}: {:?}", a.name, a.kind)).collect();
    format!(
        "// name: {}\n// block_m: {}, threads: {}, dynamic_smem: {}\n// args:\n{}\n\n{}",
        kernel.name,
        kernel.block_m,
        kernel.threads,
        kernel.dynamic_smem,
        args.join("\n"),
        source
    )
}

#[test]
fn variants_list_matches_specs_dir() {
    let dir: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "specs"].iter().collect();
    let mut stems: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str()?.strip_suffix(".attn").map(String::from))
        .collect();
    stems.sort();
    assert_eq!(stems, VARIANTS);
}

#[test]
fn forward_kernels_of_named_variants() {
    for stem in VARIANTS {
        insta::assert_snapshot!(stem, render(&emit_forward(&variant(stem))));
    }
}

#[test]
fn hopper_forward_kernels_of_named_variants() {
    // Two consumer warpgroups, 128-key tiles (the d = 128 preference): plain,
    // analytic mask, block mask (128-key tiles over 64-key mask tiles) and a
    // score mod.
    for stem in ["full", "causal", "document", "softcap"] {
        let spec = variant(stem);
        insta::assert_snapshot!(format!("wgmma_{stem}"), render(&emit_forward_with(&spec, TWO_WARPGROUPS)));
    }
}

/// Above d = 128: causal d = 256 in 80-key tiles (one Q buffer, O staged
/// in it) and DeepSeek's 192/128 split (`gqa`) in 80-key tiles (two Q
/// buffers), both warp-specialized.
#[test]
fn hopper_wide_head_kernels() {
    let wide = |block_n| TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n };
    let causal = parse_one("Causal { dtype: bf16, head_dim: 256, mask: q >= k }").unwrap();
    insta::assert_snapshot!("wgmma_causal_d256", render(&emit_forward_with(&causal, wide(80))));
    insta::assert_snapshot!("wgmma_gqa_n80", render(&emit_forward_with(&variant("gqa"), wide(80))));
}

#[test]
fn varlen_forward_kernels() {
    // Per-sequence lengths (bottom-right causal), a per-sequence tensor sized
    // by the longest sequence (documents), on mma.sync and on the persistent
    // wgmma kernel, whose producer claims past tiles beyond their sequence.
    for stem in ["causal_bottom_right", "document"] {
        let spec = variant(stem);
        let sync = emit_forward_varlen(&spec, TileConfig::default_for(&spec), TileCopy::Threads);
        insta::assert_snapshot!(format!("varlen_{stem}"), render(&sync));
        let tma = emit_forward_varlen(&spec, TWO_WARPGROUPS, TileCopy::Tma);
        insta::assert_snapshot!(format!("varlen_wgmma_{stem}"), render(&tma));
    }
}

#[test]
fn paged_forward_kernels() {
    // Paged K/V under a bottom-right causal mask (chunked prefill): the
    // sequence's clamped K/V length, rows gathered through the block table
    // on mma.sync and by the persistent wgmma kernel's threads, or its
    // walking warp's TMA boxes of a page each.
    let spec = variant("causal_bottom_right");
    let sync = emit_forward_paged(&spec, TileConfig::default_for(&spec), TileCopy::Threads);
    insta::assert_snapshot!("paged_causal_bottom_right", render(&sync));
    let threads = emit_forward_paged(&spec, TWO_WARPGROUPS, TileCopy::Threads);
    insta::assert_snapshot!("paged_wgmma_causal_bottom_right", render(&threads));
    let tma = emit_forward_paged(&spec, TWO_WARPGROUPS, TileCopy::Tma);
    insta::assert_snapshot!("paged_wgmma_tma_causal_bottom_right", render(&tma));
    insta::assert_snapshot!("paged_append_causal_bottom_right", render(&emit_paged_append(&spec)));
}

#[test]
fn decode_kernels() {
    // A score expression and a per-head tensor (ALiBi) read per row of a
    // GQA-packed tile: 8 query heads per K/V head, one token, on Hopper
    // (its last split combines the splits).
    let spec = variant("alibi");
    let config = DecodeConfig::for_rows(&spec, Target::HOPPER, 8).unwrap();
    insta::assert_snapshot!("decode_alibi", render(&emit_decode(&spec, config)));
    // The same kernel over paged caches: its lengths, rows and tile copies.
    insta::assert_snapshot!("decode_paged_alibi", render(&emit_decode_paged(&spec, config)));
    // Packed queries (a token count per sequence): a bottom-right causal
    // mask reads q_len per sequence, over a dense and a paged cache.
    let spec = variant("causal_bottom_right");
    let config = DecodeConfig::for_rows(&spec, Target::HOPPER, 32).unwrap();
    for (name, cache) in [
        ("decode_varlen_causal_bottom_right", DecodeCache::Dense),
        ("decode_paged_varlen_causal_bottom_right", DecodeCache::Paged),
    ] {
        insta::assert_snapshot!(name, render(&emit_decode_with(&spec, config, cache, DecodeQueries::Packed)));
    }
    // An e4m3 cache: byte pointers and descales, Q's columns interleaved,
    // fragments converted on registers, the descales folded into the logit's
    // scale and the rows' normalization; a sink takes V's too. Dense and paged.
    let spec = variant("sink_window");
    let config = DecodeConfig::for_cache(&spec, Target::HOPPER, 8, KvCacheDtype::E4m3).unwrap();
    insta::assert_snapshot!("decode_e4m3_sink_window", render(&emit_decode(&spec, config)));
    insta::assert_snapshot!("decode_paged_e4m3_sink_window", render(&emit_decode_paged(&spec, config)));
    // MLA's absorbed decode (QK 576 / V 512, one K/V head, 16 query heads):
    // warps split O's columns, sharing the rows' max and P through shared
    // memory; V's fragments come from K's tiles (V_IN_K), so a stage copies
    // K alone; 32-key tiles whose 576-column copies are not unrolled.
    let spec = parse_one("Mla { dtype: bf16, head_dim: 576, v_head_dim: 512, mask: q + kv_len - q_len >= k }").unwrap();
    let config = DecodeConfig::choose(&spec, Target::HOPPER, 16, KvCacheDtype::Spec, true).unwrap();
    insta::assert_snapshot!("decode_mla_causal", render(&emit_decode(&spec, config)));
}

#[test]
fn partials_kernels() {
    // Context parallelism's merge (an f16 V head dim that is not a multiple
    // of the warp, 59), add and flat add; and the merge at bf16 and 128.
    let (odd, gqa) = (parse_one(EDGE_SPECS[0].1).unwrap(), variant("gqa"));
    insta::assert_snapshot!("merge_partial_edge_odd_dims", render(&emit_merge_partial(&odd)));
    insta::assert_snapshot!("merge_partial_gqa", render(&emit_merge_partial(&gqa)));
    insta::assert_snapshot!("add_partial_gqa", render(&emit_add_partial(&gqa)));
    insta::assert_snapshot!("add_f32_gqa", render(&emit_add_f32(&gqa)));
}

#[test]
fn varlen_backward_kernels() {
    // Per-sequence lengths (bottom-right causal) and a per-sequence tensor
    // sized by the longest sequence (documents): the dK/dV and dQ kernels on
    // mma.sync, the row kernels of either accumulator, and the Hopper dK/dV
    // kernel, which adds to per-sequence tiles and copies with its threads
    // or by TMA through ragged descriptors.
    for stem in ["causal_bottom_right", "document"] {
        let spec = variant(stem);
        let portable = BackwardConfig::default_for(&spec);
        for (pass, name) in [(BackwardPass::KeyValue, "bwd_varlen"), (BackwardPass::Query, "bwd_dq_varlen")] {
            insta::assert_snapshot!(format!("{name}_{stem}"), render(&emit_backward_varlen(&spec, pass, portable)));
        }
        let hopper = BackwardConfig::preferred(&spec, Target::for_sm(9, 0));
        let threads = BackwardConfig { copy: TileCopy::Threads, ..hopper };
        let kernel = emit_backward_varlen(&spec, BackwardPass::KeyValue, threads);
        assert!(kernel.args.iter().all(|a| !matches!(a.kind, ArgKind::TensorMap(_) | ArgKind::QLen | ArgKind::KvLen)));
        insta::assert_snapshot!(format!("wgmma_bwd_varlen_{stem}"), render(&kernel));
        let tma = emit_backward_varlen(&spec, BackwardPass::KeyValue, BackwardConfig { copy: TileCopy::Tma, ..hopper });
        insta::assert_snapshot!(format!("wgmma_tma_bwd_varlen_{stem}"), render(&tma));
    }
    let spec = variant("causal");
    for (name, config) in
        [("", BackwardConfig::default_for(&spec)), ("wgmma_", BackwardConfig::preferred(&spec, Target::for_sm(9, 0)))]
    {
        for (pass, pass_name) in [(BackwardPass::Preprocess, "pre"), (BackwardPass::Postprocess, "post")] {
            let kernel = emit_backward_varlen(&spec, pass, config);
            insta::assert_snapshot!(format!("{name}bwd_{pass_name}_varlen_causal"), render(&kernel));
        }
    }
}

#[test]
fn hopper_three_warpgroup_forward_kernel() {
    // Three consumer warpgroups (192 query rows): the cycle of turns and the
    // 160-register split.
    let spec = parse_one("Full64 { dtype: bf16, head_dim: 64 }").unwrap();
    insta::assert_snapshot!("wgmma_full64", render(&emit_forward_with(&spec, THREE_WARPGROUPS)));
}

#[test]
fn hopper_document_kernels_at_d64() {
    // Three warpgroups: their three-stage ring lets the producer stage the
    // item's per-query document ids with Q, beside each tile's per-key ones.
    let source = "Document64 { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }";
    let spec = parse_one(source).unwrap();
    assert_eq!(THREE_WARPGROUPS.stages(&spec), 3);
    insta::assert_snapshot!("wgmma_document64", render(&emit_forward_with(&spec, THREE_WARPGROUPS)));
}

#[test]
fn hopper_softcap_kernel_at_d64() {
    // One consumer warpgroup per CTA, two CTAs per SM (softcap's d = 64
    // preference): launch bounds for two, a two-stage ring, no turns
    // between warpgroups.
    let source =
        "Softcap64 { dtype: bf16, head_dim: 64, param cap: f32, mask: q >= k, score: cap * tanh(score / cap) }";
    let spec = parse_one(source).unwrap();
    assert_eq!((ONE_WARPGROUP_PAIR.per_sm(), ONE_WARPGROUP_PAIR.stages(&spec)), (2, 2));
    insta::assert_snapshot!("wgmma_pair_softcap64", render(&emit_forward_with(&spec, ONE_WARPGROUP_PAIR)));
}

#[test]
fn hopper_tall_warpgroup_kernel_at_d64() {
    // One consumer warpgroup of 128 rows, two CTAs per SM: two m64 products
    // per 64-key tile, S's from Q's fragments in registers, O stored 16 rows
    // of each product at a time.
    let spec = parse_one("Causal64 { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
    assert_eq!((TALL_PAIR.per_sm(), TALL_PAIR.block_m()), (2, 128));
    insta::assert_snapshot!("wgmma_tall_causal64", render(&emit_forward_with(&spec, TALL_PAIR)));
}

#[test]
fn hopper_long_keys_window_kernel_at_d64() {
    // A sliding window's conjuncts both bound k: its partial tiles keep an
    // interval of columns per row, which fits three warpgroups' registers.
    let source = "Window64 { dtype: bf16, head_dim: 64, param window: i32, mask: q >= k && q - k < window }";
    let spec = parse_one(source).unwrap();
    let config = THREE_WARPGROUPS;
    insta::assert_snapshot!("wgmma_window64", render(&emit_forward_with(&spec, config)));
    // For layouts TMA cannot address: the producer's threads copy the tiles
    // and the consumers' store O.
    let threads = emit_forward_copying(&spec, config, TileCopy::Threads);
    insta::assert_snapshot!("wgmma_window64_threads", render(&threads));
}

#[test]
fn hopper_global_columns_kernel_at_d64() {
    // Sinks beside a window: the producer copies the first keys' column tile
    // with Q where no other disjunct keeps a pair of the first tile, and the
    // consumers run it ahead of their walk (`global_columns`).
    let source = "SinkWindow64 { dtype: bf16, head_dim: 64, param sinks: i32, param window: i32, \
                  mask: k < sinks || (q >= k && q - k < window) }";
    let spec = parse_one(source).unwrap();
    insta::assert_snapshot!("wgmma_sink_window64", render(&emit_forward_with(&spec, TWO_WARPGROUPS)));
}

#[test]
fn hopper_alibi_kernel_at_d64() {
    // At d <= 64 ALiBi's logits leave out each row's part of the bias
    // (slope * (q0 - q)): the key terms are shared by a lane's rows, and the
    // LSE adds the row's part back.
    let source = "Alibi64 { dtype: bf16, head_dim: 64, tensor slopes: f32[H], mask: q >= k, \
                  score: score + slopes[h] * (k - q) as f32 }";
    let spec = parse_one(source).unwrap();
    insta::assert_snapshot!("wgmma_alibi64", render(&emit_forward_with(&spec, THREE_WARPGROUPS)));
}

#[test]
fn forward_kernels_of_edge_specs() {
    for (name, source) in EDGE_SPECS {
        let spec = parse_one(source).unwrap_or_else(|e| panic!("{name}: {}", e.render(name, source)));
        insta::assert_snapshot!(name, render(&emit_forward(&spec)));
    }
}

/// The language's later additions (`language.attn`: `& | ^ << >> !`,
/// `rem_euclid`, `div_euclid`, dimension expressions) in every kernel kind,
/// with the optional library parts no named variant includes.
#[test]
fn kernels_of_language_features() {
    let source = include_str!("specs/language.attn");
    let spec = parse_one(source).unwrap_or_else(|e| panic!("{}", e.render("language.attn", source)));
    insta::assert_snapshot!("language", render(&emit_forward(&spec)));
    insta::assert_snapshot!("hopper_language", render(&emit_forward_with(&spec, TWO_WARPGROUPS)));
    insta::assert_snapshot!("bwd_language", render(&emit_backward(&spec, BackwardPass::KeyValue)));
    let block_mask = flashgen_codegen::cuda::emit_block_mask(&spec).expect("the spec has a mask");
    insta::assert_snapshot!("block_mask_language", render(&block_mask));
    for kernel in [emit_forward(&spec), block_mask] {
        assert!(kernel.source.contains(Part::IntOps.text()), "{}: the scalar helpers", kernel.name);
        assert!(kernel.source.contains(Part::IntRanges.text()), "{}: its mask's interval rules", kernel.name);
    }
    // A named variant includes neither.
    let causal = emit_forward(&variant("causal")).source;
    assert!(!causal.contains(Part::IntOps.text()) && !causal.contains(Part::IntRanges.text()));
}

#[test]
fn block_mask_kernels_of_data_dependent_masks() {
    // Documents evaluate undecided tiles pair by pair; a declared block
    // layout is decided by one pair per tile.
    for stem in ["document", "block_sparse"] {
        let spec = variant(stem);
        let kernel = flashgen_codegen::cuda::emit_block_mask(&spec);
        insta::assert_snapshot!(format!("block_mask_{stem}"), render(&kernel.expect("the spec has a mask")));
    }
    // Work orders come from the block mask: the dK/dV kernel's 128-key CTAs,
    // a persistent forward's 128-query items.
    use flashgen_codegen::cuda::{emit_work_order, Work};
    for (name, work) in [("key", Work::KeyTiles { block_n: 128 }), ("item", Work::QueryTiles { block_m: 128 })] {
        let order = emit_work_order(&variant("document"), work).expect("documents have a block mask");
        insta::assert_snapshot!(format!("{name}_order_document"), render(&order));
        assert!(emit_work_order(&variant("causal"), work).is_none());
    }
}

#[test]
fn backward_kernels_of_named_variants() {
    for stem in VARIANTS {
        let spec = variant(stem);
        insta::assert_snapshot!(format!("bwd_{stem}"), render(&emit_backward(&spec, BackwardPass::KeyValue)));
        insta::assert_snapshot!(format!("bwd_dq_{stem}"), render(&emit_backward(&spec, BackwardPass::Query)));
    }
    // The row kernels depend on the spec only through dtype and head dims.
    let spec = variant("causal");
    insta::assert_snapshot!("bwd_pre_causal", render(&emit_backward(&spec, BackwardPass::Preprocess)));
    insta::assert_snapshot!("bwd_post_causal", render(&emit_backward(&spec, BackwardPass::Postprocess)));
}

/// Above DP + DVP = 384 two warps share 16 keys, each holding half of dK's
/// and dV's columns; only part 0 adds the tensors' gradients (here ALiBi's
/// slopes, at d = 256).
#[test]
fn halved_columns_backward_kernel() {
    let spec = parse_one(
        "WideAlibi { dtype: bf16, head_dim: 256, tensor slopes: f32[H], \
         score: score - slopes[h] * (q - k) as f32, mask: q >= k }",
    )
    .unwrap();
    assert_eq!(BackwardConfig::default_for(&spec).columns, KeyColumns::Halves);
    insta::assert_snapshot!("bwd_column_halves_alibi_256", render(&emit_backward(&spec, BackwardPass::KeyValue)));
}

#[test]
fn hopper_backward_kernels_of_named_variants() {
    // The warp-specialized wgmma dK/dV kernel: analytic mask, block mask, and a
    // score mod with a trainable tensor (ALiBi slopes).
    for stem in ["causal", "document", "alibi"] {
        let spec = variant(stem);
        let config = BackwardConfig::preferred(&spec, Target::for_sm(9, 0));
        assert_eq!(config.mma, Mma::Wgmma, "{stem}");
        insta::assert_snapshot!(
            format!("wgmma_bwd_{stem}"),
            render(&emit_backward_with(&spec, BackwardPass::KeyValue, config))
        );
    }
    // ALiBi without the slopes' gradient: P and dS split as for a plain score.
    let spec = variant("alibi");
    let config = BackwardConfig { tensor_grads: false, ..BackwardConfig::preferred(&spec, Target::for_sm(9, 0)) };
    let kernel = emit_backward_with(&spec, BackwardPass::KeyValue, config);
    assert!(kernel.args.iter().all(|a| !matches!(a.kind, ArgKind::TensorGrad(_))));
    insta::assert_snapshot!("wgmma_bwd_alibi_no_tensor_grads", render(&kernel));
    // For layouts TMA cannot address: every producer thread copies, and no
    // descriptor is an argument.
    let spec = variant("causal");
    let config = BackwardConfig { copy: TileCopy::Threads, ..BackwardConfig::preferred(&spec, Target::for_sm(9, 0)) };
    let kernel = emit_backward_with(&spec, BackwardPass::KeyValue, config);
    assert!(kernel.args.iter().all(|a| !matches!(a.kind, ArgKind::TensorMap(_))));
    insta::assert_snapshot!("wgmma_bwd_causal_threads", render(&kernel));
    // Head dim 64: 128-query steps, each warpgroup dQ's of its own 64 queries;
    // dS from P's 16-bit fragments.
    let spec = parse_one("Causal64 { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
    let config = BackwardConfig::preferred(&spec, Target::for_sm(9, 0));
    insta::assert_snapshot!("wgmma_bwd_causal_d64", render(&emit_backward_with(&spec, BackwardPass::KeyValue, config)));
    // Documents at head dim 64: 128-query steps, the producer stages each
    // step's document ids beside its statistics.
    let spec =
        parse_one("Document64 { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }")
            .unwrap();
    let config = BackwardConfig::preferred(&spec, Target::for_sm(9, 0));
    insta::assert_snapshot!(
        "wgmma_bwd_document_d64",
        render(&emit_backward_with(&spec, BackwardPass::KeyValue, config))
    );
    // Head dim 96: the second warpgroup's dQ columns cross a panel boundary,
    // so the producer copies K's upper half again into a panel of its own.
    let spec = parse_one("Causal96 { dtype: bf16, head_dim: 96, mask: q >= k }").unwrap();
    let config = BackwardConfig::preferred(&spec, Target::for_sm(9, 0));
    insta::assert_snapshot!("wgmma_bwd_causal_d96", render(&emit_backward_with(&spec, BackwardPass::KeyValue, config)));
    // Its dQ accumulator, in fragment order, back to rows.
    let spec = variant("causal");
    let config = BackwardConfig::preferred(&spec, Target::for_sm(9, 0));
    assert_eq!(config.dq_accum(&spec), DqAccum::Fragments { cols: 128, order: DqOrder::HeadDims, step_rows: 80 });
    insta::assert_snapshot!(
        "wgmma_bwd_post_causal",
        render(&emit_backward_with(&spec, BackwardPass::Postprocess, config))
    );
}

/// The Hopper dK/dV kernel with column halves (both warpgroups on 64 keys,
/// each half of dK's, dV's and dQ's columns), a `--bwd-tiles` choice above
/// d = 128: at 192/128 K's and Q's halves start 32 columns into a panel, so
/// each product takes two chunks and the second warpgroup's accumulator is
/// rotated into column order; with ALiBi at 256 only the first warpgroup
/// adds the slopes' gradient.
#[test]
fn hopper_backward_column_halves() {
    let mla = parse_one("Mla { dtype: bf16, head_dim: 192, v_head_dim: 128, mask: q >= k }").unwrap();
    insta::assert_snapshot!("wgmma_bwd_halves_causal_192_128", hopper_backward(&mla, KeyColumns::Halves));
    let alibi = parse_one(
        "Alibi256 { dtype: bf16, head_dim: 256, tensor slopes: f32[H], mask: q >= k, score: score + slopes[h] * (k - q) as f32 }",
    )
    .unwrap();
    insta::assert_snapshot!("wgmma_bwd_halves_alibi_256", hopper_backward(&alibi, KeyColumns::Halves));
}

/// The Hopper dK/dV kernel in transposed tiles (each warpgroup 48 keys, S
/// with queries as rows, dKᵀ and dVᵀ with head dims as rows), the runtime's
/// choice from 129 through 192: at 192/128 dQ's second half takes two
/// chunks, stored rotated into column order; softcap at 160 (padded to
/// 192) splits no element pass and evaluates the score mod's derivative.
#[test]
fn hopper_backward_transposed() {
    let mla = parse_one("Mla { dtype: bf16, head_dim: 192, v_head_dim: 128, mask: q >= k }").unwrap();
    insta::assert_snapshot!("wgmma_bwd_transposed_causal_192_128", hopper_backward(&mla, KeyColumns::Transposed));
    let softcap =
        parse_one("Softcap160 { dtype: bf16, head_dim: 160, mask: q >= k, score: 30.0 * tanh(score / 30.0) }").unwrap();
    insta::assert_snapshot!("wgmma_bwd_transposed_softcap_160", hopper_backward(&softcap, KeyColumns::Transposed));
}

/// `spec`'s Hopper dK/dV kernel with `columns`, rendered.
fn hopper_backward(spec: &Spec, columns: KeyColumns) -> String {
    let hopper = Target::for_sm(9, 0);
    let tile = BackwardConfig::tiles(spec, hopper).into_iter().find(|t| t.mma == Mma::Wgmma && t.columns == columns);
    let tile = tile.unwrap_or_else(|| panic!("a Hopper tile {columns:?} for {}", spec.name));
    render(&emit_backward_with(spec, BackwardPass::KeyValue, BackwardConfig::preferred(spec, hopper).with_tile(tile)))
}

/// Dropout's kernels (the mask, `library/dropout.cuh`, applied to P):
/// the forward on mma.sync and the warp-specialized wgmma one (copying by
/// TMA, FADD row sums), the portable dK/dV and dQ kernels and the Hopper
/// dK/dV kernel; the mask's four arguments come last.
#[test]
fn dropout_kernels() {
    let spec = variant("causal");
    let hopper = Target::for_sm(9, 0);
    let sync = TileConfig::default_for(&spec);
    insta::assert_snapshot!("dropout_causal", render(&emit_forward_dropout(&spec, sync, TileCopy::Threads)));
    let wgmma = emit_forward_dropout(&spec, TWO_WARPGROUPS, TileCopy::Tma);
    insta::assert_snapshot!("dropout_wgmma_causal", render(&wgmma));
    let softcap = variant("softcap");
    insta::assert_snapshot!(
        "dropout_wgmma_softcap",
        render(&emit_forward_dropout(&softcap, ONE_WARPGROUP_PAIR, TileCopy::Tma))
    );
    let portable = BackwardConfig { dropout: true, ..BackwardConfig::default_for(&spec) };
    let preferred = BackwardConfig { dropout: true, ..BackwardConfig::preferred(&spec, hopper) };
    let kernels = [
        ("dropout_bwd_causal", emit_backward_with(&spec, BackwardPass::KeyValue, portable)),
        ("dropout_bwd_dq_causal", emit_backward_with(&spec, BackwardPass::Query, portable)),
        ("dropout_wgmma_bwd_causal", emit_backward_with(&spec, BackwardPass::KeyValue, preferred)),
    ];
    for (name, kernel) in kernels.iter().chain([("", wgmma)].iter()) {
        let last: Vec<ArgKind> = kernel.args.iter().rev().take(4).rev().map(|a| a.kind).collect();
        assert_eq!(last, DropoutArg::ALL.map(ArgKind::Dropout), "{}", kernel.name);
        assert!(kernel.name.contains("dropout"), "{}", kernel.name);
        if !name.is_empty() {
            insta::assert_snapshot!(*name, render(kernel));
        }
    }
    // Without dropout, the preprocess and postprocess are the only kernels;
    // with it they are unchanged.
    for pass in [BackwardPass::Preprocess, BackwardPass::Postprocess] {
        let plain = emit_backward_with(&spec, pass, BackwardConfig::default_for(&spec));
        assert_eq!(emit_backward_with(&spec, pass, portable.for_pass(pass)).source, plain.source);
    }
}

/// Hopper's dK/dV kernel: whole columns where both head dims pad alike to
/// 64 through 128 (but 112), transposed tiles where the wider pads to 144
/// through 256, column halves above 192 under masks that read tensors;
/// elsewhere the portable kernel, even when asked for wgmma.
#[test]
fn wgmma_backward_covers_whole_columns_to_128_and_transposed_or_halves_to_256() {
    let hopper = Target::for_sm(9, 0);
    let (whole, halves, transposed) = (Some(KeyColumns::Whole), Some(KeyColumns::Halves), Some(KeyColumns::Transposed));
    for (source, columns) in [
        ("A { dtype: bf16, head_dim: 128, mask: q >= k }", whole),
        ("B { dtype: f16, head_dim: 120, mask: q >= k }", whole),
        ("C { dtype: bf16, head_dim: 64, mask: q >= k }", whole),
        ("F { dtype: bf16, head_dim: 59, mask: q >= k }", whole),
        ("G { dtype: bf16, head_dim: 80, mask: q >= k }", whole),
        ("H { dtype: bf16, head_dim: 96, mask: q >= k }", whole),
        ("I { dtype: bf16, head_dim: 112, mask: q >= k }", None),
        ("D { dtype: bf16, head_dim: 128, v_head_dim: 64 }", None),
        ("E { dtype: bf16, head_dim: 192, v_head_dim: 128 }", transposed),
        ("J { dtype: bf16, head_dim: 256, mask: q >= k }", transposed),
        ("O { dtype: bf16, head_dim: 256, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }", halves),
        ("K { dtype: bf16, head_dim: 160 }", transposed),
        ("N { dtype: bf16, head_dim: 128, v_head_dim: 192 }", transposed),
        ("L { dtype: bf16, head_dim: 224, v_head_dim: 200 }", transposed),
        ("M { dtype: bf16, head_dim: 264 }", None),
    ] {
        let spec = parse_one(source).unwrap();
        let preferred = BackwardConfig::preferred(&spec, hopper);
        assert_eq!((preferred.mma == Mma::Wgmma).then_some(preferred.columns), columns, "{source}");
        let kernel = emit_backward_with(&spec, BackwardPass::KeyValue, preferred);
        assert_eq!(kernel.source.contains("wgmma.mma_async"), columns.is_some(), "{source}");
        // A wgmma configuration where the kernel does not apply emits the portable one.
        if columns.is_none() {
            let forced = BackwardConfig { mma: Mma::Wgmma, ..BackwardConfig::default_for(&spec) };
            let kernel = emit_backward_with(&spec, BackwardPass::KeyValue, forced);
            assert_eq!(kernel.source, emit_backward(&spec, BackwardPass::KeyValue).source, "{source}");
        }
    }
}

/// Column halves span head dims padded to whole panels: the dK/dV kernel's
/// products, the dQ accumulator's tiles and the row kernels that zero and
/// read them agree on the width.
#[test]
fn column_halves_pad_head_dims_to_whole_panels() {
    let hopper = Target::for_sm(9, 0);
    for (qk, v, dp, dvp) in
        [(160u32, 160u32, 192, 192), (224, 200, 256, 256), (176, 128, 192, 128), (192, 128, 192, 128)]
    {
        let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v}, mask: q >= k }}")).unwrap();
        let config = BackwardConfig::preferred(&spec, hopper);
        assert_eq!(
            config.dq_accum(&spec),
            DqAccum::Fragments { cols: dp, order: DqOrder::Queries, step_rows: 64 },
            "{qk}/{v}"
        );
        assert_eq!(config.dq_accum(&spec).len(&spec, 2, 65), 2 * 128 * dp as usize, "{qk}/{v}");
        let kernel = emit_backward_with(&spec, BackwardPass::KeyValue, config);
        let dims = match (dp, dvp) == (qk.next_multiple_of(16), v.next_multiple_of(16)) {
            true => format!("constexpr int DP = {dp};"),
            false => format!("constexpr int DP = {dp}, DVP = {dvp};"),
        };
        assert!(kernel.source.contains(&dims), "{qk}/{v}: {dims}");
        for pass in [BackwardPass::Preprocess, BackwardPass::Postprocess] {
            let rows = emit_backward_with(&spec, pass, config.for_pass(pass));
            assert!(rows.source.contains(&format!("constexpr int DQ_COLS = {dp};")), "{qk}/{v} {pass:?}");
        }
    }
}

/// The e4m3 forward: 224-key tiles of bytes read as 16-bit tiles, 8-bit
/// wgmma, P packed in the V tiles' key order, the descales in the scale and
/// O's factor; and the V-tile kernel it reads.
#[test]
fn e4m3_forward_kernels() {
    let spec = variant("causal");
    let config = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 224 };
    insta::assert_snapshot!("wgmma_fwd_e4m3_causal", render(&emit_forward_e4m3(&spec, config).unwrap()));
    insta::assert_snapshot!("e4m3_v_tiles_causal_224", render(&emit_e4m3_v_tiles(&spec, 224)));
    // Tiles of whole 32-key steps from 96 keys, pipelined, on Hopper only;
    // QK head dims of whole k-steps.
    for block_n in [64, 80, 288] {
        assert!(emit_forward_e4m3(&spec, TileConfig { block_n, ..config }).is_none(), "{block_n} keys");
    }
    let d80 = parse_one("S { dtype: bf16, head_dim: 80 }").unwrap();
    assert!(emit_forward_e4m3(&d80, config).is_none());
    // One m64 product per warpgroup.
    assert!(emit_forward_e4m3(&spec, TileConfig { warps: 4, m_tiles: 2, block_n: 128, ..config }).is_none());
    assert!(!e4m3_supports(&spec, config, Target::for_sm(8, 0)));
}

#[test]
fn emission_is_deterministic() {
    for stem in VARIANTS {
        let spec = variant(stem);
        assert_eq!(emit_forward(&spec), emit_forward(&spec.clone()), "{stem}");
    }
}

#[test]
fn signature_follows_args() {
    for stem in VARIANTS {
        let kernel = emit_forward(&variant(stem));
        let entry = format!("{}(\n", kernel.name);
        let start = kernel.source.find(&entry).expect("entry point") + entry.len();
        let params = &kernel.source[start..start + kernel.source[start..].find(") {").expect("end of signature")];
        let names: Vec<&str> = params.split(',').map(|p| p.split_whitespace().last().unwrap()).collect();
        let expected: Vec<&str> = kernel.args.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, expected, "{stem}");
    }
}
