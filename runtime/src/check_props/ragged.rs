//! The ragged launches' checks: varlen forward and backward
//! (`check_varlen.rs`), the paged forward and append (`check_paged.rs`).
//! The kernels clamp the device-side prefix sums, lengths and page ids into
//! the host-checked sizes, so what must hold is host-visible: every operand
//! and cache inside its buffer, and the prefix sums, block table, lengths
//! and LSE holding the entries the kernel reads.

use super::{
    args, assert_holds, assert_inside, dtype, head_dims, need, no_panic, specs, wild, within_limits, Rng, CASES, EDGES,
    LEN,
};
use crate::args::ArgInfo;
use crate::check::{Buffer, Grads, Problem};
use crate::check_paged::{check_append, check_paged, AppendProblem, PackedChecked, PagedProblem};
use crate::check_varlen::{check_varlen, check_varlen_backward, VarlenProblem, VarlenShape};
use crate::layout::Layout;
use crate::paged::{PagedLayout, PagedShape};
use flashgen_codegen::{Shape, Spec};
use std::fmt::Debug;

const INT: u128 = i32::MAX as u128;

/// A buffer for `layout`: perturbed and of a drawn length where `wild`,
/// else exact.
pub(super) fn buffer(rng: &mut Rng, layout: Layout, wild: bool) -> Buffer {
    let layout = if wild { rng.wild(layout) } else { layout };
    let len = if wild { rng.len(need(&layout)) } else { need(&layout) };
    Buffer { layout, len }
}

/// The longest of `tokens` split into sequences: where `wild`, at times 0,
/// more than the tokens, or an edge.
fn longest(rng: &mut Rng, tokens: usize, wild: bool) -> usize {
    match wild && rng.odd(20) {
        true => {
            let edge = rng.pick(&EDGES);
            rng.pick(&[0, tokens.saturating_add(1), edge])
        }
        false if tokens == 0 => 0,
        false => 1 + rng.below(tokens.min(1 << 20)),
    }
}

/// Sizes of a `[1, tokens, heads, dim]` packed operand.
fn rows(l: &Layout) -> [usize; 4] {
    [l.batch, l.seq, l.heads, l.dim]
}

#[derive(Debug)]
struct Varlen {
    spec: usize,
    p: VarlenProblem,
    g: Grads,
    args: Vec<ArgInfo>,
}

fn draw_varlen(rng: &mut Rng, specs: &[Spec], wild: bool) -> Varlen {
    let spec_index = rng.below(specs.len());
    let spec = &specs[spec_index];
    let (batch, tq, tk) = match wild {
        true => (rng.size(4), rng.size(40), rng.size(40)),
        false => (rng.below(5), rng.below(40), rng.below(40)),
    };
    let (heads, heads_kv) = if wild { rng.heads() } else { rng.pick(&[(1, 1), (4, 2), (6, 3), (8, 1)]) };
    let [qk, v] = head_dims(rng, spec, wild);
    let shapes = [[tq, heads, qk], [tk, heads_kv, qk], [tk, heads_kv, v], [tq, heads, v]];
    let [q, k, v, o] = shapes.map(|s| {
        let l = rng.packed(s);
        buffer(rng, l, wild)
    });
    let lse = heads.saturating_mul(tq);
    let lse = if wild { rng.opt_len(lse) } else { rng.pick(&[None, Some(lse)]) };
    let operands = Problem { dtype: if wild { dtype(rng, spec) } else { spec.dtype }, q, k, v, o, lse };
    let cu_seqlens = match wild {
        true => [0, 1].map(|_| rng.count(batch.saturating_add(1))),
        false => [batch + 1; 2],
    };
    let max_lens = [tq, tk].map(|t| longest(rng, t, wild));
    let [d_o, dq, dk, dv] = [o, q, k, v].map(|b| {
        let l = rng.packed([b.layout.seq, b.layout.heads, b.layout.dim]);
        buffer(rng, l, wild)
    });
    let p = VarlenProblem { operands, batch, cu_seqlens, max_lens };
    let shape = Shape { batch, heads, heads_kv, q_len: max_lens[0], kv_len: max_lens[1] };
    let args = args(spec, &shape, wild && rng.odd(5));
    Varlen { spec: spec_index, p, g: Grads { d_o, dq, dk, dv }, args }
}

/// What an accepted varlen launch must hold (`grads`: the backward's).
fn assert_varlen_sound(d: &Varlen, spec: &Spec, grads: bool, launch: Option<VarlenShape>) {
    let (case, ops): (&dyn Debug, _) = (d, &d.p.operands);
    let mut buffers = vec![("Q", ops.q), ("K", ops.k), ("V", ops.v), ("O", ops.o)];
    if grads {
        buffers.extend([("dO", d.g.d_o), ("dQ", d.g.dq), ("dK", d.g.dk), ("dV", d.g.dv)]);
    }
    for (what, b) in &buffers {
        assert_inside(what, &b.layout, b.len, launch.is_some(), case);
    }
    let Some(VarlenShape { shape, tokens: [tq, tk] }) = launch else { return };
    let (qk, v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let sound = [
        rows(&ops.q.layout) == [1, tq, shape.heads, qk],
        rows(&ops.k.layout) == [1, tk, shape.heads_kv, qk],
        rows(&ops.v.layout) == [1, tk, shape.heads_kv, v],
        rows(&ops.o.layout) == [1, tq, shape.heads, v],
        [shape.batch, shape.q_len, shape.kv_len] == [d.p.batch, d.p.max_lens[0], d.p.max_lens[1]],
        shape.heads_kv > 0 && shape.heads.is_multiple_of(shape.heads_kv),
        within_limits(&shape) && tq as u128 <= LEN && tk as u128 <= LEN,
        shape.q_len <= tq && shape.kv_len <= tk,
        ops.dtype == spec.dtype,
    ];
    assert!(sound.iter().all(|&ok| ok), "accepted an unsound launch ({sound:?}): {case:?}");
    for (which, len) in ["cu_seqlens_q", "cu_seqlens_k"].into_iter().zip(d.p.cu_seqlens) {
        assert_holds(which, len, shape.batch as u128 + 1, case);
    }
    if grads {
        for (grad, of) in [d.g.d_o, d.g.dq, d.g.dk, d.g.dv].iter().zip([ops.o, ops.q, ops.k, ops.v]) {
            assert_eq!(rows(&grad.layout), rows(&of.layout), "a gradient's sizes differ: {case:?}");
        }
    }
    if let Some(len) = ops.lse {
        assert_holds("LSE", len, shape.heads as u128 * tq as u128, case);
    }
}

#[test]
fn varlen_accepts_only_launches_inside_its_buffers() {
    let (specs, mut rng, mut accepted) = (specs(), Rng::new(0x7A), 0);
    for case in 0..2 * CASES {
        let d = draw_varlen(rng.case(), &specs, true);
        let spec = &specs[d.spec];
        let grads = case % 2 == 1;
        let result = match grads {
            true => no_panic(&d, || check_varlen_backward(spec, &d.p, &d.g, &d.args)),
            false => no_panic(&d, || check_varlen(spec, &d.p, &d.args)),
        };
        if let Ok(launch) = result {
            assert_varlen_sound(&d, spec, grads, launch);
            accepted += 1;
        }
    }
    assert!(accepted > CASES / 10, "only {accepted} of {} wild draws accepted", 2 * CASES);
}

#[test]
fn well_formed_varlen_launches_pass() {
    let (specs, mut rng) = (specs(), Rng::new(0x7B));
    for _ in 0..CASES {
        let mut d = draw_varlen(&mut rng, &specs, false);
        let spec = &specs[d.spec];
        let (ops, [q_len, kv_len]) = (&d.p.operands, d.p.max_lens);
        let shape = Shape { batch: d.p.batch, heads: ops.q.layout.heads, heads_kv: ops.k.layout.heads, q_len, kv_len };
        let checked = VarlenShape { shape, tokens: [ops.q.layout.seq, ops.k.layout.seq] };
        let launched = shape.batch > 0 && q_len > 0;
        assert_eq!(check_varlen(spec, &d.p, &d.args).unwrap(), launched.then_some(checked), "{d:?}");
        let backward = (shape.batch > 0).then_some(checked);
        assert_eq!(check_varlen_backward(spec, &d.p, &d.g, &d.args).unwrap(), backward, "{d:?}");
        if launched && !ops.k.layout.is_empty() {
            d.p.operands.k.len -= 1;
            assert!(check_varlen(spec, &d.p, &d.args).is_err(), "K one short: {d:?}");
        }
    }
}

/// A cache of these sizes from a constructor's layout (`[pages, rows,
/// heads, dim]` as `[batch, seq, heads, dim]`), in a buffer.
fn cache(rng: &mut Rng, sizes: [usize; 4], wild: bool) -> (PagedLayout, usize) {
    let l = rng.layout(sizes);
    let Buffer { layout: l, len } = buffer(rng, l, wild);
    let layout = PagedLayout {
        num_pages: l.batch,
        page_size: l.seq,
        heads: l.heads,
        dim: l.dim,
        strides: l.strides,
        offset: l.offset,
    };
    (layout, len)
}

/// Paged caches of `batch` sequences: K and V of `heads_kv` heads and head
/// dims `dims`, the block table, lengths and longest length.
pub(super) fn draw_caches(rng: &mut Rng, batch: usize, heads_kv: usize, dims: [usize; 2], wild: bool) -> PagedShape {
    let (num_pages, page_size, pages_per_seq) = match wild {
        true => {
            let (num_pages, size) = (rng.size(10), rng.size(20));
            (num_pages, rng.pick(&[0, 1, 16, size]), rng.size(4))
        }
        false => (rng.below(10), rng.pick(&[1, 4, 16]), rng.below(4)),
    };
    let capacity = if num_pages == 0 { 0 } else { pages_per_seq.saturating_mul(page_size) };
    let max_kv_len = match wild && rng.odd(20) {
        true => {
            let edge = rng.pick(&EDGES);
            rng.pick(&[capacity.saturating_add(1), edge])
        }
        false => rng.below(capacity.min(1 << 20) + 1),
    };
    let mut sizes = dims.map(|dim| [num_pages, page_size, heads_kv, dim]);
    if wild && rng.odd(10) {
        sizes[1][rng.below(3)] = rng.size(10);
    }
    let table = batch.saturating_mul(pages_per_seq);
    PagedShape {
        caches: sizes.map(|s| cache(rng, s, wild)),
        table_len: if wild { rng.count(table) } else { table },
        kv_lens_len: if wild { rng.count(batch) } else { batch },
        pages_per_seq,
        max_kv_len,
        batch,
    }
}

/// What an accepted launch must hold of its caches, table and lengths.
pub(super) fn assert_caches_sound(kv: &PagedShape, dims: [usize; 2], launched: bool, case: &dyn Debug) {
    let [(k, k_len), (v, v_len)] = kv.caches;
    assert_inside("K cache", &k.as_layout(), k_len, launched, case);
    assert_inside("V cache", &v.as_layout(), v_len, launched, case);
    if !launched {
        return;
    }
    let sound = [
        // The kernel clamps V's page ids by K's page count, divides by the page size.
        (v.num_pages, v.page_size, v.heads) == (k.num_pages, k.page_size, k.heads),
        [k.dim, v.dim] == dims,
        k.page_size > 0,
        [k.num_pages, k.page_size, kv.pages_per_seq].iter().all(|&n| n as u128 <= INT),
    ];
    assert!(sound.iter().all(|&ok| ok), "accepted unsound caches ({sound:?}): {case:?}");
    assert_holds("block_table", kv.table_len, kv.batch as u128 * kv.pages_per_seq as u128, case);
    assert_holds("kv_lens", kv.kv_lens_len, kv.batch as u128, case);
}

#[derive(Debug)]
struct Paged {
    spec: usize,
    p: PagedProblem,
    args: Vec<ArgInfo>,
}

fn draw_paged(rng: &mut Rng, specs: &[Spec], wild: bool) -> Paged {
    let spec_index = rng.below(specs.len());
    let spec = &specs[spec_index];
    let batch = if wild { rng.size(4) } else { rng.below(5) };
    let (heads, heads_kv) = if wild { rng.heads() } else { rng.pick(&[(1, 1), (4, 2), (6, 3), (8, 1)]) };
    let [qk, v] = head_dims(rng, spec, wild);
    let packed = rng.chance(60);
    let (max_q_len, tokens) = match packed {
        true => {
            let tokens = if wild { rng.size(40) } else { rng.below(40) };
            (longest(rng, tokens, wild), tokens)
        }
        false => {
            let max = if wild { rng.size(4) } else { rng.below(5) };
            let tokens = batch.saturating_mul(max);
            (max, if wild && rng.odd(10) { tokens.saturating_add(1) } else { tokens })
        }
    };
    let [q, o] = [[tokens, heads, qk], [tokens, heads, v]].map(|s| {
        let l = rng.packed(s);
        buffer(rng, l, wild)
    });
    let lse = heads.saturating_mul(tokens);
    let lse = if wild { rng.opt_len(lse) } else { rng.pick(&[None, Some(lse)]) };
    let cu_seqlens_q = packed.then(|| if wild { rng.count(batch.saturating_add(1)) } else { batch + 1 });
    let kv = draw_caches(rng, batch, heads_kv, [qk, v], wild);
    let dtype = if wild { dtype(rng, spec) } else { spec.dtype };
    let p = PagedProblem { dtype, q, o, lse, kv, cu_seqlens_q, max_q_len };
    let shape = Shape { batch, heads, heads_kv, q_len: max_q_len, kv_len: kv.max_kv_len };
    Paged { spec: spec_index, p, args: args(spec, &shape, wild && rng.odd(5)) }
}

fn assert_paged_sound(d: &Paged, spec: &Spec, launch: Option<PackedChecked>) {
    let (case, p): (&dyn Debug, _) = (d, &d.p);
    let dims = [spec.head_dims.qk as usize, spec.head_dims.v as usize];
    assert_inside("Q", &p.q.layout, p.q.len, launch.is_some(), case);
    assert_inside("O", &p.o.layout, p.o.len, launch.is_some(), case);
    assert_caches_sound(&p.kv, dims, launch.is_some(), case);
    let Some(PackedChecked { shape, total_q }) = launch else { return };
    let sound = [
        rows(&p.q.layout) == [1, total_q, shape.heads, dims[0]],
        rows(&p.o.layout) == [1, total_q, shape.heads, dims[1]],
        shape.heads_kv == p.kv.caches[0].0.heads && shape.heads_kv > 0 && shape.heads.is_multiple_of(shape.heads_kv),
        [shape.batch, shape.q_len, shape.kv_len] == [p.kv.batch, p.max_q_len, p.kv.max_kv_len],
        within_limits(&shape) && total_q as u128 <= INT,
        p.dtype == spec.dtype,
    ];
    assert!(sound.iter().all(|&ok| ok), "accepted an unsound launch ({sound:?}): {case:?}");
    match p.cu_seqlens_q {
        Some(len) => {
            assert_holds("cu_seqlens_q", len, shape.batch as u128 + 1, case);
            assert!(shape.q_len <= total_q, "a sequence longer than Q's tokens: {case:?}");
        }
        // Dense queries: sequence b's rows are b · q_len + [0, q_len).
        None => assert_holds("Q's tokens", total_q, shape.batch as u128 * shape.q_len as u128, case),
    }
    if let Some(len) = p.lse {
        assert_holds("LSE", len, shape.heads as u128 * total_q as u128, case);
    }
}

#[test]
fn paged_forward_accepts_only_launches_inside_its_buffers() {
    let specs = specs();
    let check = |d: &Paged| check_paged(&specs[d.spec], &d.p, &d.args);
    wild(
        0x9A,
        20,
        |rng| draw_paged(rng, &specs, true),
        check,
        |d, launch| assert_paged_sound(d, &specs[d.spec], launch),
    );
}

#[test]
fn well_formed_paged_launches_pass() {
    let (specs, mut rng) = (specs(), Rng::new(0x9B));
    for _ in 0..CASES {
        let mut d = draw_paged(&mut rng, &specs, false);
        let spec = &specs[d.spec];
        let p = &d.p;
        let (heads, heads_kv) = (p.q.layout.heads, p.kv.caches[0].0.heads);
        let (batch, q_len, kv_len) = (p.kv.batch, p.max_q_len, p.kv.max_kv_len);
        let shape = Shape { batch, heads, heads_kv, q_len, kv_len };
        let launched = batch > 0 && q_len > 0;
        let checked = PackedChecked { shape, total_q: p.q.layout.seq };
        assert_eq!(check_paged(spec, p, &d.args).unwrap(), launched.then_some(checked), "{d:?}");
        if !d.p.kv.caches[1].0.as_layout().is_empty() {
            d.p.kv.caches[1].1 -= 1;
            assert!(check_paged(spec, &d.p, &d.args).is_err(), "V cache one short: {d:?}");
        }
    }
}

fn draw_append(rng: &mut Rng, specs: &[Spec], wild: bool) -> (usize, AppendProblem) {
    let spec_index = rng.below(specs.len());
    let spec = &specs[spec_index];
    let batch = if wild { rng.size(4) } else { rng.below(5) };
    let heads_kv = if wild { rng.heads().1 } else { rng.pick(&[1, 2, 3]) };
    let [qk, v] = head_dims(rng, spec, wild);
    let tokens = if wild { rng.size(40) } else { rng.below(40) };
    let rows = [[tokens, heads_kv, qk], [tokens, heads_kv, v]].map(|s| {
        let l = rng.packed(s);
        buffer(rng, l, wild)
    });
    let kv = PagedShape { max_kv_len: 0, ..draw_caches(rng, batch, heads_kv, [qk, v], wild) };
    let cu_seqlens = if wild { rng.count(batch.saturating_add(1)) } else { batch + 1 };
    let (new_kv_lens, dropped) = match wild {
        true => {
            let (lens, dropped) = (rng.count(batch), rng.count(1));
            (rng.pick(&[None, Some(lens)]), rng.pick(&[None, Some(dropped)]))
        }
        false => (rng.pick(&[None, Some(batch)]), rng.pick(&[None, Some(1)])),
    };
    let max_new_len = longest(rng, tokens, wild);
    let dtype = if wild { dtype(rng, spec) } else { spec.dtype };
    (spec_index, AppendProblem { dtype, rows, kv, cu_seqlens, max_new_len, new_kv_lens, dropped })
}

#[test]
fn paged_append_accepts_only_launches_inside_its_buffers() {
    let (specs, mut rng, mut accepted) = (specs(), Rng::new(0xAA), 0);
    for _ in 0..CASES {
        let (spec, p) = draw_append(rng.case(), &specs, true);
        let (spec, case): (_, &dyn Debug) = (&specs[spec], &p);
        let Ok(launched) = no_panic(case, || check_append(spec, &p)) else { continue };
        accepted += 1;
        let dims = [spec.head_dims.qk as usize, spec.head_dims.v as usize];
        for (what, b) in ["new K rows", "new V rows"].into_iter().zip(p.rows) {
            assert_inside(what, &b.layout, b.len, launched, case);
        }
        assert_caches_sound(&p.kv, dims, launched, case);
        if !launched {
            continue;
        }
        let [k, v] = p.rows.map(|b| b.layout);
        let heads = p.kv.caches[0].0.heads;
        assert_eq!([rows(&k), rows(&v)], [[1, k.seq, heads, dims[0]], [1, k.seq, heads, dims[1]]], "{case:?}");
        assert!(p.kv.batch <= 65_535 && k.seq as u128 <= INT && p.max_new_len <= k.seq, "{case:?}");
        assert_holds("cu_seqlens", p.cu_seqlens, p.kv.batch as u128 + 1, case);
        assert_holds("new_kv_lens", p.new_kv_lens.unwrap_or(usize::MAX), p.kv.batch as u128, case);
        assert_holds("dropped", p.dropped.unwrap_or(usize::MAX), 1, case);
    }
    assert!(accepted > CASES / 20, "only {accepted} of {CASES} wild draws accepted");
}

#[test]
fn well_formed_appends_pass() {
    let (specs, mut rng) = (specs(), Rng::new(0xAB));
    for _ in 0..CASES {
        let (spec, mut p) = draw_append(&mut rng, &specs, false);
        assert_eq!(check_append(&specs[spec], &p).unwrap(), p.kv.batch > 0, "{p:?}");
        if !p.rows[0].layout.is_empty() {
            p.rows[0].len -= 1;
            assert!(check_append(&specs[spec], &p).is_err(), "new K rows one short: {p:?}");
        }
    }
}
