//! Block masks (`block_mask.rs`): the build's checks and the classes'
//! layout (`check_block_mask`), and a mask against the launches it serves
//! (`BuiltFor::check_launch`). The build kernel writes one byte per (slice,
//! query tile, key tile); the forward and backward kernels read tile
//! `(i, j)` of batch `b` and head `h` at `b · strides[0] + h · strides[1] +
//! i · kv_tiles + j`, both at the spec's mask tile.

use super::{args, no_panic, within_limits, Rng, CASES};
use crate::args::ArgInfo;
use crate::block_mask::{check_block_mask, BuiltFor, MaskLayout};
use crate::check::MAX_GRID_YZ;
use crate::error::Error;
use flashgen_codegen::cuda::TileConfig;
use flashgen_codegen::{parse_one, Builtin, Shape, Spec};

/// Masks that read neither `b` nor `h`, `b` only, `h` only and both, and a
/// spec without one.
fn mask_specs() -> [Spec; 5] {
    [
        "C { dtype: bf16, head_dim: 64, mask: q >= k }",
        "T { dtype: bf16, head_dim: 128, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
        "S { dtype: f16, head_dim: 128, tensor layout: i32[H, 16, 16], mask: layout[h][q / 128][k / 128] != 0 }",
        "D { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], tensor on: i32[H], \
           mask: doc[b][q] == doc[b][k] && on[h] != 0 }",
        "P { dtype: bf16, head_dim: 64 }",
    ]
    .map(|s| parse_one(s).unwrap())
}

fn draw_shape(rng: &mut Rng, wild: bool) -> Shape {
    let (heads, heads_kv) = match wild {
        true => rng.heads(),
        false => rng.pick(&[(1, 1), (4, 2), (8, 1), (3, 3)]),
    };
    let [batch, q_len, kv_len] = match wild {
        true => [rng.size(4), rng.size(700), rng.size(700)],
        false => [rng.below(5), rng.below(700), rng.below(700)],
    };
    Shape { batch, heads, heads_kv, q_len, kv_len }
}

/// What a mask of `layout` for a launch of `shape` must be: computed here
/// in i128 from the spec's mask tile, every tile the launch reads and the
/// build writes inside the buffer, slices that do not overlap, and a grid
/// CUDA launches.
fn assert_mask_sound(spec: &Spec, shape: &Shape, layout: &MaskLayout, case: &dyn std::fmt::Debug) {
    let mask = spec.mask.as_ref().expect("built without a mask");
    let (bm, bn) = TileConfig::mask_tile(spec);
    let q_tiles = (shape.q_len as i128 + bm as i128 - 1) / bm as i128;
    let kv_tiles = (shape.kv_len as i128 + bn as i128 - 1) / bn as i128;
    let tiles = q_tiles * kv_tiles;
    let heads = if mask.uses(Builtin::H) { shape.heads as i128 } else { 1 };
    let batches = if mask.uses(Builtin::B) { shape.batch as i128 } else { 1 };
    let [s_b, s_h] = layout.strides.map(i128::from);
    let len = layout.len as i128;
    assert!(len >= 1 && layout.tiles as i128 == tiles && layout.slices as i128 == batches * heads, "{case:?}");
    assert!(within_limits(shape) && heads * batches <= MAX_GRID_YZ as i128 && q_tiles <= MAX_GRID_YZ as i128);
    // A launch reads every (b, h) of its shape; an axis the mask ignores broadcasts.
    assert!((batches > 1 || s_b == 0) && (heads > 1 || s_h == 0), "a broadcast axis has a stride: {case:?}");
    if shape.batch > 0 && shape.heads > 0 && tiles > 0 {
        let last = (shape.batch as i128 - 1) * s_b + (shape.heads as i128 - 1) * s_h + tiles - 1;
        assert!(s_b >= 0 && s_h >= 0 && last < len, "a launch reads tile {last} of {len}: {case:?}");
        assert!(batches * heads * tiles <= len, "the build writes past {len}: {case:?}");
        // Slices of distinct (b, h) lie apart.
        assert!(heads <= 1 || s_h >= tiles, "head slices overlap: {case:?}");
        assert!(batches <= 1 || s_b >= (heads - 1) * s_h + tiles, "batch slices overlap: {case:?}");
    }
}

#[test]
fn block_masks_hold_every_tile_their_launches_read() {
    let (specs, mut rng, mut accepted) = (mask_specs(), Rng::new(0xB1), 0);
    for _ in 0..CASES {
        let spec = &specs[rng.case().below(specs.len())];
        let shape = draw_shape(&mut rng, true);
        let args = args(spec, &shape, rng.odd(5));
        let case = (&spec.name, shape, &args);
        match no_panic(&case, || check_block_mask(spec, &shape, &args)) {
            Ok(layout) => {
                assert_mask_sound(spec, &shape, &layout, &case);
                accepted += 1;
            }
            Err(Error::NoMask { .. }) => assert!(spec.mask.is_none(), "{case:?}"),
            Err(_) => {}
        }
    }
    assert!(accepted > CASES / 10, "only {accepted} of {CASES} wild draws accepted");
    for _ in 0..CASES {
        let spec = &specs[rng.below(specs.len() - 1)];
        let shape = draw_shape(&mut rng, false);
        let layout = check_block_mask(spec, &shape, &args(spec, &shape, false));
        let layout = layout.unwrap_or_else(|e| panic!("{e}: {shape:?} {}", spec.name));
        assert_mask_sound(spec, &shape, &layout, &(&spec.name, shape));
        // A tensor one entry short is refused.
        if !spec.tensors.is_empty() && shape.batch > 0 && shape.kv_len > 0 {
            assert!(check_block_mask(spec, &shape, &args(spec, &shape, true)).is_err(), "{shape:?}");
        }
    }
}

/// A launch of a mask built for `(spec, shape, args, tensors)`: the same,
/// or at times one of them other.
fn perturb(rng: &mut Rng, specs: &[Spec], built: &BuiltFor) -> (usize, Shape, Vec<ArgInfo>, Vec<u64>) {
    let spec = match rng.odd(15) {
        true => rng.below(specs.len()),
        false => specs.iter().position(|s| s.name == built.spec.name).unwrap(),
    };
    let mut shape = built.shape;
    if rng.odd(15) {
        let size = rng.size(300);
        let fields = [&mut shape.batch, &mut shape.heads, &mut shape.heads_kv, &mut shape.q_len, &mut shape.kv_len];
        *fields.into_iter().nth(rng.below(5)).unwrap() = size;
    }
    let args = match rng.odd(15) {
        true => args(&specs[spec], &shape, rng.chance(50)),
        false => built.args.clone(),
    };
    let mut tensors = built.tensors.clone();
    if rng.odd(15) {
        tensors.iter_mut().for_each(|t| *t += 256);
    }
    (spec, shape, args, tensors)
}

#[test]
fn block_masks_serve_only_the_launch_they_were_built_for() {
    let (specs, mut rng, mut served) = (mask_specs(), Rng::new(0xB2), 0);
    for _ in 0..CASES {
        let spec = &specs[rng.case().below(specs.len() - 1)];
        let shape = draw_shape(&mut rng, false);
        let args = args(spec, &shape, false);
        let Ok(layout) = check_block_mask(spec, &shape, &args) else { continue };
        let tensors: Vec<u64> = spec.tensors.iter().map(|_| 0x7f00_0000_0000 + 256 * rng.below(1000) as u64).collect();
        let built = BuiltFor::new(spec, shape, &args, &tensors);
        let (other, got, got_args, got_tensors) = perturb(&mut rng, &specs, &built);
        let case = (&built, &specs[other].name, got, &got_args, &got_tensors);
        let result = no_panic(&case, || built.check_launch(&specs[other], got, &got_args, &got_tensors));
        let same = specs[other].name == spec.name && got == shape && got_args == args && got_tensors == tensors;
        match result {
            Ok(()) => {
                assert!(same, "a mask served another launch: {case:?}");
                assert_mask_sound(spec, &got, &layout, &case);
                served += 1;
            }
            Err(err) => assert!(!same && matches!(err, Error::BlockMaskMismatch { .. }), "{err}: {case:?}"),
        }
    }
    assert!(served > CASES / 4, "only {served} of {CASES} launches served");
}
