//! The layouts' fit: head dims covered, stages and dQ tiles in Hopper's
//! shared memory, the runtime's preferred steps.

use super::*;
use crate::cuda::backward::{BackwardPass, BackwardTile, DqAccum};

fn spec(qk: u32, v: u32) -> Spec {
    crate::parse_one(&format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v} }}")).unwrap()
}

fn layout(qk: u32, v: u32, columns: KeyColumns) -> Option<Layout> {
    let config = BackwardConfig { mma: Mma::Wgmma, columns, ..BackwardConfig::default_for(&spec(qk, v)) };
    Layout::of(&spec(qk, v), config)
}

/// Each warpgroup's chunks cover its columns once; a chunk that starts
/// inside a 64-column panel ends in it; both warpgroups issue the same
/// widths.
#[test]
fn chunks_cover_each_warpgroups_columns_within_panels() {
    for d in (16..=256).step_by(16) {
        for columns in [KeyColumns::Whole, KeyColumns::Halves] {
            let Some(chunks) = chunks(columns, d) else { continue };
            let (parts, per_part) = (columns.parts(), d / columns.parts());
            for part in 0..parts as usize {
                let mut cols: Vec<u32> = chunks.iter().flat_map(|c| c.first[part]..c.first[part] + c.width).collect();
                cols.sort_unstable();
                let own = part as u32 * per_part;
                assert_eq!(cols, (own..own + per_part).collect::<Vec<_>>(), "d = {d}, part {part}");
                for c in chunks.iter() {
                    let inside = c.first[part] % 64;
                    assert!(inside == 0 || inside + c.width <= 64, "d = {d}: {c:?} crosses a panel");
                }
            }
        }
    }
}

/// Whole columns cover head dims 64 through 128 but 112; halves the
/// wider dims through 256, padded to whole panels.
#[test]
fn layouts_cover_the_head_dims_they_fit() {
    let whole: Vec<u32> = (16..=256).step_by(16).filter(|&d| layout(d, d, KeyColumns::Whole).is_some()).collect();
    assert_eq!(whole, [64, 80, 96, 128]);
    let halves: Vec<u32> = (16..=272).step_by(8).filter(|&d| layout(d, d, KeyColumns::Halves).is_some()).collect();
    assert_eq!(halves, (136..=256).step_by(8).collect::<Vec<_>>());
    for (qk, v, padded) in [
        (256, 256, [256, 256]),
        (160, 160, [192, 192]),
        (224, 200, [256, 256]),
        (192, 128, [192, 128]),
        (144, 128, [192, 128]),
        (256, 64, [256, 64]),
    ] {
        let layout = layout(qk, v, KeyColumns::Halves).unwrap_or_else(|| panic!("{qk}/{v}"));
        assert_eq!((layout.block_n(), layout.padded), (64, padded), "{qk}/{v}");
    }
    assert!(layout(128, 128, KeyColumns::Halves).is_none());
}

/// 128-query steps at d = 64 where the elements split into P then dS
/// (no score mod, no dropout): dQ by rows, one dQ tile buffer in
/// Hopper's shared memory; asked for elsewhere, 64-query steps. The
/// runtime prefers them, under a tensor-reading mask too.
#[test]
fn long_query_steps_where_p_and_ds_split() {
    let spec = |body: &str| crate::parse_one(&format!("S {{ dtype: bf16, head_dim: 64{body} }}")).unwrap();
    let long = |spec: &Spec, dropout| {
        let tile = BackwardTile::hopper(KeyColumns::Whole, 128);
        let config = BackwardConfig { dropout, ..BackwardConfig::default_for(spec).with_tile(tile) };
        Layout::of(spec, config).unwrap().block_m
    };
    let (causal, softcap) = (spec(", mask: q >= k"), spec(", score: 30.0 * tanh(score / 30.0)"));
    assert_eq!([long(&causal, false), long(&causal, true), long(&softcap, false)], [128, 64, 64]);
    let layout = Layout::of(&causal, BackwardConfig::preferred(&causal, Target::HOPPER)).unwrap();
    assert_eq!((layout.block_m, layout.dq_split(), layout.dq_n(), layout.dq_bufs), (128, DqSplit::Rows, 64, 1));
    let hopper = Target::HOPPER;
    assert!(layout.smem_bytes(&causal) + layout.static_smem() <= hopper.smem_per_sm - hopper.smem_reserved_per_cta);
    let document =
        crate::parse_one("S { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }")
            .unwrap();
    let preferred = |spec: &Spec| BackwardConfig::preferred(spec, Target::HOPPER).block_m;
    assert_eq!([preferred(&document), preferred(&softcap)], [128, 64]);
}

/// 80-query steps at d = 128 (and dims padding to it) without a score
/// mod or dropout: dQ by head dims, one dQ tile, within Hopper's shared
/// memory; the runtime prefers them but under a mask that reads tensors.
/// With dropout a configuration takes 64-query steps, and every pass
/// then reads the dQ accumulator in the order its dK/dV kernel stores.
#[test]
fn transposed_dq_steps_at_128() {
    let spec = |body: &str| crate::parse_one(&format!("S {{ dtype: bf16, {body} }}")).unwrap();
    let hopper = Target::HOPPER;
    let limit = hopper.smem_per_sm - hopper.smem_reserved_per_cta;
    let (causal, padded) = (spec("head_dim: 128, mask: q >= k"), spec("head_dim: 120"));
    for spec in [&causal, &padded] {
        let config = BackwardConfig::preferred(spec, hopper);
        let layout = Layout::of(spec, config).unwrap();
        assert_eq!((layout.block_m, layout.dq_split(), layout.dq_n(), layout.dq_bufs), (80, DqSplit::HeadDims, 80, 1));
        assert!(layout.smem_bytes(spec) + layout.static_smem() <= limit);
        assert_eq!(config.dq_accum(spec), DqAccum::Fragments { cols: 128, order: DqOrder::HeadDims, step_rows: 80 });
    }
    let softcap = spec("head_dim: 128, score: 30.0 * tanh(score / 30.0)");
    let document = spec("head_dim: 128, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k]");
    let narrow = spec("head_dim: 96");
    for spec in [&softcap, &document, &narrow] {
        assert_eq!(BackwardConfig::preferred(spec, hopper).block_m, 64, "{}", spec.name);
    }
    let tile = BackwardTile::hopper(KeyColumns::Whole, TRANSPOSED_DQ_STEP);
    for spec in [&causal, &padded, &softcap, &document, &narrow, &spec("head_dim: 64")] {
        for dropout in [false, true] {
            let config = BackwardConfig::preferred(spec, hopper).with_tile(tile).with_dropout(spec, dropout);
            let post = config.for_pass(BackwardPass::Postprocess);
            assert_eq!(post.dq_accum(spec), config.dq_accum(spec), "{} dropout {dropout}", spec.name);
        }
    }
}

/// Without tuning, masked specs take 64-query steps where 80 are
/// preferred up to 1024 queries; full attention, d = 64's 128-query
/// steps and targets without wgmma keep their configuration at every
/// length.
#[test]
fn short_sequences_take_64_query_steps() {
    let spec = |body: &str| crate::parse_one(&format!("S {{ dtype: bf16, {body} }}")).unwrap();
    let steps = |spec: &Spec, q_len| BackwardConfig::preferred_for(spec, Target::HOPPER, q_len).block_m;
    let causal = spec("head_dim: 128, mask: q >= k");
    assert_eq!([0, 512, 1024, 1025, 16384].map(|n| steps(&causal, n)), [64, 64, 64, 80, 80]);
    let short = BackwardConfig::preferred_for(&causal, Target::HOPPER, 512);
    assert_eq!(short.dq_accum(&causal), DqAccum::Fragments { cols: 128, order: DqOrder::Queries, step_rows: 64 });
    assert_eq!([512, 16384].map(|n| steps(&spec("head_dim: 128"), n)), [80, 80]);
    assert_eq!([512, 16384].map(|n| steps(&spec("head_dim: 64, mask: q >= k"), n)), [128, 128]);
    let portable = BackwardConfig::preferred(&causal, Target::PORTABLE);
    assert_eq!(BackwardConfig::preferred_for(&causal, Target::PORTABLE, 512), portable);
}

/// Transposed tiles cover the wider head dim padding to 144 through 256:
/// 96 keys per CTA (48 per warpgroup) through 192, 64 above; two stages
/// at 192/128 and 128/192, one at 192 and 256; every one within Hopper's shared
/// memory. The runtime prefers them but above 192 under a tensor-reading
/// mask.
#[test]
fn transposed_tiles_cover_144_through_256() {
    let hopper = Target::HOPPER;
    let limit = hopper.smem_per_sm - hopper.smem_reserved_per_cta;
    let covered: Vec<u32> = (16..=272).step_by(8).filter(|&d| layout(d, d, KeyColumns::Transposed).is_some()).collect();
    assert_eq!(covered, (136..=256).step_by(8).collect::<Vec<_>>());
    for (qk, v, block_n, stages) in
        [(192, 128, 96, 2), (192, 192, 96, 1), (160, 160, 96, 1), (128, 192, 96, 2), (256, 256, 64, 1)]
    {
        let layout = layout(qk, v, KeyColumns::Transposed).unwrap();
        assert_eq!((layout.block_n(), layout.stages, layout.k_half_cols()), (block_n, stages, None), "{qk}/{v}");
        assert!(layout.smem_bytes(&spec(qk, v)) + layout.static_smem() <= limit, "{qk}/{v}");
    }
    let preferred = |spec: &Spec| BackwardConfig::preferred(spec, hopper).columns;
    assert_eq!(
        [preferred(&spec(192, 128)), preferred(&spec(160, 160)), preferred(&spec(256, 256))],
        [KeyColumns::Transposed; 3]
    );
    let documents = |d| {
        crate::parse_one(&format!(
            "S {{ dtype: bf16, head_dim: {d}, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }}"
        ))
        .unwrap()
    };
    assert_eq!([preferred(&documents(192)), preferred(&documents(256))], [KeyColumns::Transposed, KeyColumns::Halves]);
}

/// Every laid-out kernel fits Hopper's shared memory, with the most
/// stages where they fit: two at 192/128, one at 256.
#[test]
fn halves_take_the_stages_that_fit() {
    let hopper = Target::HOPPER;
    let limit = hopper.smem_per_sm - hopper.smem_reserved_per_cta;
    for (qk, v, stages, dq_bufs) in [(256, 256, 1, 1), (192, 128, 2, 1), (256, 128, 2, 1)] {
        let layout = layout(qk, v, KeyColumns::Halves).unwrap();
        assert_eq!((layout.stages, layout.dq_bufs), (stages, dq_bufs), "{qk}/{v}");
        assert!(layout.smem_bytes(&spec(qk, v)) + layout.static_smem() <= limit);
    }
}

/// Persistent kernels where d = 64 takes 128-query steps, dense operands
/// copied by TMA; not at d = 128 (80-query steps) or in 64-query steps, nor
/// over packed sequences or thread copies.
#[test]
fn persistent_where_steps_are_long_at_64() {
    let spec = |body: &str| crate::parse_one(&format!("S {{ dtype: bf16, {body} }}")).unwrap();
    let layout_of = |spec: &Spec| Layout::of(spec, BackwardConfig::preferred(spec, Target::HOPPER)).unwrap();
    let causal = spec("head_dim: 64, mask: q >= k");
    let layout = layout_of(&causal);
    assert!(layout.persistent(TileCopy::Tma, Packing::Dense));
    assert!(!layout.persistent(TileCopy::Tma, Packing::Varlen));
    assert!(!layout.persistent(TileCopy::Threads, Packing::Dense));
    for other in [spec("head_dim: 128, mask: q >= k"), spec("head_dim: 64, score: 30.0 * tanh(score / 30.0)")] {
        assert!(!layout_of(&other).persistent(TileCopy::Tma, Packing::Dense), "{}", other.name);
    }
    let kernel = emit(&causal, BackwardConfig::preferred(&causal, Target::HOPPER), &layout, Packing::Dense);
    assert_eq!(kernel.grid, Grid::KeyUnits);
    assert!(kernel.args.iter().any(|a| a.kind == ArgKind::WorkCounter));
}
