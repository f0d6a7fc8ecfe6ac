//! The decode checks: plans (`check_decode.rs`), paged decode launches and
//! decode steps over packed queries (`check_decode_varlen.rs`).

use super::ragged::{assert_caches_sound, buffer, draw_caches};
use super::{
    args, assert_holds, assert_inside, dtype, head_dims, no_panic, specs, wild, within_limits, Rng, CASES, EDGES, LEN,
};
use crate::args::ArgInfo;
use crate::check::Buffer;
use crate::check_decode::{check_launch, check_paged_launch, check_plan_shape, check_splits, check_v_in_k};
use crate::check_decode::{DecodeShape, PagedDecodeProblem};
use crate::check_decode_varlen::{check_varlen_decode, CacheShape, VarlenDecodeProblem};
use crate::check_paged::PackedChecked;
use flashgen_codegen::cuda::MAX_SPLITS;
use flashgen_codegen::{Shape, Spec};
use std::fmt::Debug;

const INT: u128 = i32::MAX as u128;

fn draw_plan(rng: &mut Rng, wild: bool) -> DecodeShape {
    let (heads, heads_kv) = if wild { rng.heads() } else { rng.pick(&[(1, 1), (8, 2), (32, 8), (16, 1)]) };
    let q_len = if wild && rng.odd(10) { rng.pick(&[0, usize::MAX]) } else { 1 + rng.below(4) };
    let (batch, max_kv_len) = if wild { (rng.size(8), rng.size(4096)) } else { (rng.below(9), rng.below(4097)) };
    DecodeShape { batch, heads, heads_kv, q_len, max_kv_len }
}

#[test]
fn plans_accept_only_shapes_the_kernels_index() {
    let mut rng = Rng::new(0xDE);
    for _ in 0..CASES {
        let plan = draw_plan(rng.case(), true);
        let Ok(()) = no_panic(&plan, || check_plan_shape(&plan)) else { continue };
        let DecodeShape { batch, heads, heads_kv, q_len, max_kv_len } = plan;
        // The split partials hold batch · heads · q_len rows per split, i32-indexed.
        let rows = batch as u128 * heads as u128 * q_len as u128;
        let sound = [
            heads_kv > 0 && heads.is_multiple_of(heads_kv),
            q_len > 0,
            batch <= 65_535 && heads_kv <= 65_535 && max_kv_len as u128 <= LEN,
            rows * MAX_SPLITS as u128 <= INT,
            heads as u128 * q_len as u128 * MAX_SPLITS as u128 <= INT,
        ];
        assert!(sound.iter().all(|&ok| ok), "accepted an unsound plan ({sound:?}): {plan:?}");
        assert_eq!(plan.group_rows(), heads / heads_kv * q_len, "{plan:?}");
    }
    for _ in 0..CASES {
        let plan = draw_plan(&mut rng, false);
        assert!(check_plan_shape(&plan).is_ok(), "{plan:?}");
    }
}

#[test]
fn splits_launches_and_v_in_k_accept_exactly_what_they_document() {
    let mut rng = Rng::new(0xDF);
    for splits in (0..=300).chain(EDGES) {
        let ok = (1..=MAX_SPLITS as usize).contains(&splits);
        assert_eq!(no_panic(&splits, || check_splits(splits)).ok(), ok.then_some(splits as u32));
    }
    for _ in 0..CASES {
        let plan = draw_plan(rng.case(), true);
        let mut got = plan.as_shape();
        if rng.odd(30) {
            let size = rng.size(8);
            let fields = [&mut got.batch, &mut got.heads, &mut got.heads_kv, &mut got.q_len, &mut got.kv_len];
            *fields.into_iter().nth(rng.below(5)).unwrap() = size;
        }
        let kv_lens = rng.count(plan.batch);
        let case = (plan, got, kv_lens);
        let accepted = no_panic(&case, || check_launch(&plan, &got, kv_lens)).is_ok();
        assert_eq!(accepted, got == plan.as_shape() && kv_lens >= plan.batch, "{case:?}");
        // V read from K's tiles: only where it is K's own view.
        let k = rng.layout([plan.batch, 3, plan.heads_kv, 64]);
        let v = rng.wild(crate::layout::Layout { dim: 32, ..k });
        let v_ptr = rng.pick(&[0x1000, 0x2000]);
        let same = v_ptr == 0x1000 && v.offset == k.offset && v.strides == k.strides;
        assert_eq!(check_v_in_k((0x1000, k), (v_ptr, v)).is_ok(), same, "{k:?} {v:?}");
    }
}

#[derive(Debug)]
struct PagedDecode {
    spec: usize,
    p: PagedDecodeProblem,
    args: Vec<ArgInfo>,
}

fn draw_paged_decode(rng: &mut Rng, specs: &[Spec], wild: bool) -> PagedDecode {
    let spec_index = rng.below(specs.len());
    let spec = &specs[spec_index];
    let plan = draw_plan(rng, wild);
    let [qk, v] = head_dims(rng, spec, wild);
    let [q, o] = [qk, v].map(|dim| {
        let l = rng.layout([plan.batch, plan.q_len, plan.heads, dim]);
        buffer(rng, l, wild)
    });
    let kv_batch = if wild && rng.odd(10) { rng.size(8) } else { plan.batch };
    let kv = draw_caches(rng, kv_batch, plan.heads_kv, [qk, v], wild);
    let rows = plan.batch.saturating_mul(plan.heads).saturating_mul(plan.q_len);
    let lse = if wild { rng.opt_len(rows) } else { rng.pick(&[None, Some(rows)]) };
    let dtype = if wild { dtype(rng, spec) } else { spec.dtype };
    let p = PagedDecodeProblem { dtype, q, o, lse, kv };
    let shape = Shape { kv_len: kv.max_kv_len, ..plan.as_shape() };
    PagedDecode { spec: spec_index, p, args: args(spec, &shape, wild && rng.odd(5)) }
}

fn sizes(b: &Buffer) -> [usize; 4] {
    let l = &b.layout;
    [l.batch, l.seq, l.heads, l.dim]
}

fn assert_paged_decode_sound(d: &PagedDecode, spec: &Spec, launch: Option<Shape>) {
    let (case, p): (&dyn Debug, _) = (d, &d.p);
    let dims = [spec.head_dims.qk as usize, spec.head_dims.v as usize];
    assert_inside("Q", &p.q.layout, p.q.len, launch.is_some(), case);
    assert_inside("O", &p.o.layout, p.o.len, launch.is_some(), case);
    assert_caches_sound(&p.kv, dims, launch.is_some(), case);
    let Some(shape) = launch else { return };
    let sound = [
        sizes(&p.q) == [shape.batch, shape.q_len, shape.heads, dims[0]],
        sizes(&p.o) == [shape.batch, shape.q_len, shape.heads, dims[1]],
        shape.batch == p.kv.batch && shape.kv_len == p.kv.max_kv_len,
        shape.heads_kv == p.kv.caches[0].0.heads && shape.heads_kv > 0 && shape.heads.is_multiple_of(shape.heads_kv),
        within_limits(&shape),
        p.dtype == spec.dtype,
    ];
    assert!(sound.iter().all(|&ok| ok), "accepted an unsound launch ({sound:?}): {case:?}");
    if let Some(len) = p.lse {
        assert_holds("LSE", len, shape.batch as u128 * shape.heads as u128 * shape.q_len as u128, case);
    }
}

#[test]
fn paged_decode_accepts_only_launches_inside_its_buffers() {
    let specs = specs();
    let check = |d: &PagedDecode| check_paged_launch(&specs[d.spec], &d.p, &d.args);
    let sound = |d: &PagedDecode, launch| assert_paged_decode_sound(d, &specs[d.spec], launch);
    let mut rng = wild(0xD1, 20, |rng| draw_paged_decode(rng, &specs, true), check, sound);
    for _ in 0..CASES {
        let d = draw_paged_decode(&mut rng, &specs, false);
        let spec = &specs[d.spec];
        let launch = check_paged_launch(spec, &d.p, &d.args).unwrap_or_else(|e| panic!("{e}: {d:?}"));
        let q = &d.p.q.layout;
        let shape = Shape {
            batch: q.batch,
            heads: q.heads,
            heads_kv: d.p.kv.caches[0].0.heads,
            q_len: q.seq,
            kv_len: d.p.kv.max_kv_len,
        };
        assert_eq!(launch, (shape.batch > 0).then_some(shape), "{d:?}");
    }
}

#[derive(Debug)]
struct VarlenDecode {
    spec: usize,
    plan: DecodeShape,
    p: VarlenDecodeProblem,
    args: Vec<ArgInfo>,
}

fn draw_varlen_decode(rng: &mut Rng, specs: &[Spec], wild: bool) -> VarlenDecode {
    let spec_index = rng.below(specs.len());
    let spec = &specs[spec_index];
    let plan = draw_plan(rng, wild);
    let [qk, v] = head_dims(rng, spec, wild);
    let tokens = match wild && rng.odd(20) {
        true => rng.size(40),
        false => plan.q_len.saturating_add(rng.below(40)),
    };
    let [q, o] = [qk, v].map(|dim| {
        let l = rng.packed([tokens, plan.heads, dim]);
        buffer(rng, l, wild)
    });
    let cu_seqlens_q = if wild { rng.count(plan.batch.saturating_add(1)) } else { plan.batch + 1 };
    let kv_batch = if wild && rng.odd(10) { rng.size(8) } else { plan.batch };
    let cache = match rng.chance(50) {
        true => CacheShape::Paged(draw_caches(rng, kv_batch, plan.heads_kv, [qk, v], wild)),
        false => {
            let rows = if wild && rng.odd(10) { rng.size(100) } else { plan.max_kv_len.min(200) };
            let [k, v] = [qk, v].map(|dim| {
                let l = rng.layout([kv_batch, rows, plan.heads_kv, dim]);
                buffer(rng, l, wild)
            });
            CacheShape::Dense { k, v }
        }
    };
    let lse = plan.heads.saturating_mul(tokens);
    let lse = if wild { rng.opt_len(lse) } else { rng.pick(&[None, Some(lse)]) };
    let dtype = if wild { dtype(rng, spec) } else { spec.dtype };
    let p = VarlenDecodeProblem { dtype, q, o, lse, cu_seqlens_q, cache };
    let kv_len = match cache {
        CacheShape::Paged(kv) => kv.max_kv_len,
        CacheShape::Dense { k, .. } => k.layout.seq,
    };
    let args = args(spec, &Shape { kv_len, ..plan.as_shape() }, wild && rng.odd(5));
    VarlenDecode { spec: spec_index, plan, p, args }
}

fn assert_varlen_decode_sound(d: &VarlenDecode, spec: &Spec, launch: Option<PackedChecked>) {
    let (case, p): (&dyn Debug, _) = (d, &d.p);
    let dims = [spec.head_dims.qk as usize, spec.head_dims.v as usize];
    let launched = launch.is_some();
    assert_inside("Q", &p.q.layout, p.q.len, launched, case);
    assert_inside("O", &p.o.layout, p.o.len, launched, case);
    let (batch, heads_kv, kv_len) = match &p.cache {
        CacheShape::Paged(kv) => {
            assert_caches_sound(kv, dims, launched, case);
            (kv.batch, kv.caches[0].0.heads, kv.max_kv_len)
        }
        CacheShape::Dense { k, v } => {
            assert_inside("K", &k.layout, k.len, launched, case);
            assert_inside("V", &v.layout, v.len, launched, case);
            let (rows, heads) = (k.layout.seq, k.layout.heads);
            let ok = sizes(k) == [k.layout.batch, rows, heads, dims[0]]
                && sizes(v) == [k.layout.batch, rows, heads, dims[1]];
            assert!(!launched || ok, "accepted a dense cache of other sizes: {case:?}");
            (k.layout.batch, heads, rows)
        }
    };
    let Some(PackedChecked { shape, total_q }) = launch else { return };
    let sound = [
        sizes(&p.q) == [1, total_q, shape.heads, dims[0]],
        sizes(&p.o) == [1, total_q, shape.heads, dims[1]],
        [shape.batch, shape.q_len, shape.heads_kv, shape.kv_len] == [d.plan.batch, d.plan.q_len, heads_kv, kv_len],
        batch == d.plan.batch && shape.q_len <= total_q,
        shape.heads_kv > 0 && shape.heads.is_multiple_of(shape.heads_kv),
        within_limits(&shape) && total_q as u128 <= INT,
        p.dtype == spec.dtype,
    ];
    assert!(sound.iter().all(|&ok| ok), "accepted an unsound step ({sound:?}): {case:?}");
    assert_holds("cu_seqlens_q", p.cu_seqlens_q, shape.batch as u128 + 1, case);
    if let Some(len) = p.lse {
        assert_holds("LSE", len, shape.heads as u128 * total_q as u128, case);
    }
}

#[test]
fn varlen_decode_accepts_only_steps_inside_its_buffers() {
    let specs = specs();
    let check = |d: &VarlenDecode| check_varlen_decode(&specs[d.spec], &d.plan, &d.p, &d.args);
    let sound = |d: &VarlenDecode, launch| assert_varlen_decode_sound(d, &specs[d.spec], launch);
    let mut rng = wild(0xD2, 20, |rng| draw_varlen_decode(rng, &specs, true), check, sound);
    for _ in 0..CASES {
        let d = draw_varlen_decode(&mut rng, &specs, false);
        let spec = &specs[d.spec];
        let launch = check_varlen_decode(spec, &d.plan, &d.p, &d.args).unwrap_or_else(|e| panic!("{e}: {d:?}"));
        assert_eq!(launch.map(|c| c.total_q), (d.plan.batch > 0).then_some(d.p.q.layout.seq), "{d:?}");
    }
}
