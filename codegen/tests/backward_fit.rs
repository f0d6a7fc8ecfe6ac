//! The backward kernels' shared memory against what one CTA may take on
//! each target family: `BackwardConfig::preferred` shrinks the portable
//! tiles until they fit, over head dims up to 256 and unequal QK / V dims.
//! (`flashgen-runtime`'s `kernels_fit_shared_memory` checks every kernel a
//! launch may use.)

use flashgen_codegen::cuda::{emit_backward_with, BackwardConfig, BackwardPass, KeyColumns, Mma, Target};
use flashgen_codegen::parse_one;

const PASSES: [BackwardPass; 4] =
    [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Query, BackwardPass::Postprocess];

/// Head-dim pairs (QK, V): every multiple of 8 up to `widest` alike, and
/// the unequal pairs of today's models.
fn head_dims(widest: u32) -> impl Iterator<Item = (u32, u32)> {
    let alike = (8..=widest).step_by(8).map(|d| (d, d));
    let unequal = [(192, 128), (256, 128), (128, 64), (64, 128)].into_iter();
    alike.chain(unequal.filter(move |&(qk, v)| qk.max(v) <= widest))
}

/// The shared memory of `(qk, v)`'s widest backward kernel on `target`.
fn widest_kernel(qk: u32, v: u32, target: Target) -> (u32, BackwardConfig) {
    let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v}, mask: q >= k }}")).unwrap();
    let config = BackwardConfig::preferred(&spec, target);
    let smem = PASSES.iter().map(|&pass| emit_backward_with(&spec, pass, config.for_pass(pass)).dynamic_smem);
    (smem.max().unwrap(), config)
}

fn cta_limit(target: Target) -> u32 {
    target.smem_per_sm - target.smem_reserved_per_cta
}

#[test]
fn every_backward_kernel_fits_a100_and_hopper_up_to_head_dim_256() {
    for target in [Target::for_sm(8, 0), Target::for_sm(9, 0)] {
        for (qk, v) in head_dims(256) {
            let (smem, config) = widest_kernel(qk, v, target);
            assert!(smem <= cta_limit(target), "{qk}/{v} on sm_{:?}: {smem} bytes with {config:?}", target.sm);
        }
    }
}

#[test]
fn every_backward_kernel_fits_99_kib_gpus_up_to_head_dim_256() {
    let target = Target::for_sm(8, 9);
    for (qk, v) in head_dims(256) {
        let (smem, config) = widest_kernel(qk, v, target);
        assert!(smem <= cta_limit(target), "{qk}/{v}: {smem} bytes with {config:?}");
    }
}

/// On an A100, d = 256 keeps its column halves at 16-query steps (32 need
/// 168 KiB); Hopper runs its wgmma kernel in transposed tiles.
#[test]
fn a100_column_halves_take_16_query_steps_at_256() {
    let (_, a100) = widest_kernel(256, 256, Target::for_sm(8, 0));
    assert_eq!((a100.mma, a100.columns, a100.block_m), (Mma::Sync, KeyColumns::Halves, 16));
    let (_, hopper) = widest_kernel(256, 256, Target::for_sm(9, 0));
    assert_eq!((hopper.mma, hopper.columns), (Mma::Wgmma, KeyColumns::Transposed));
}

/// Where nothing needs fitting, the portable configuration is the default.
#[test]
fn a100_keeps_the_default_below_256() {
    for (qk, v) in [(64, 64), (128, 128), (192, 128)] {
        let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v} }}")).unwrap();
        assert_eq!(
            BackwardConfig::preferred(&spec, Target::for_sm(8, 0)),
            BackwardConfig::default_for(&spec),
            "{qk}/{v}"
        );
    }
}

/// A launch may choose among `BackwardConfig::tiles`: the preferred tile
/// first, each once, each generated within the target's shared memory.
#[test]
fn listed_tiles_lead_with_the_preferred_and_fit() {
    for target in [Target::for_sm(8, 0), Target::for_sm(8, 9), Target::for_sm(9, 0)] {
        for (qk, v) in head_dims(256).filter(|(qk, _)| qk % 32 == 0) {
            let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v} }}")).unwrap();
            let preferred = BackwardConfig::preferred(&spec, target);
            let tiles = BackwardConfig::tiles(&spec, target);
            assert_eq!(tiles[0], preferred.tile(), "{qk}/{v}");
            for (i, &tile) in tiles.iter().enumerate() {
                assert!(!tiles[..i].contains(&tile), "{qk}/{v}: {tile} twice");
                let kernel = emit_backward_with(&spec, BackwardPass::KeyValue, preferred.with_tile(tile));
                assert!(kernel.dynamic_smem <= cta_limit(target), "{qk}/{v} on sm_{:?}: {tile}", target.sm);
            }
        }
    }
    // Hopper lists both kernels at d = 128, and column halves at 256.
    let tiles =
        |d| BackwardConfig::tiles(&parse_one(&format!("S {{ dtype: bf16, head_dim: {d} }}")).unwrap(), Target::HOPPER);
    assert!(tiles(128).iter().any(|t| t.mma == Mma::Sync) && tiles(128)[0].mma == Mma::Wgmma);
    assert!(
        tiles(256).iter().any(|t| t.columns == KeyColumns::Halves)
            && tiles(256).iter().any(|t| t.columns == KeyColumns::Whole)
    );
}
