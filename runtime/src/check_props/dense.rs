//! `check_forward` and `check_backward` (`check.rs`): batched Q, K, V, O,
//! the LSE and the gradients.

use super::{args, assert_holds, assert_inside, dtype, head_dims, need, specs, wild, within_limits, Rng, CASES};
use crate::args::ArgInfo;
use crate::check::{check_backward, check_forward, Buffer, Grads, Problem};
use crate::error::Error;
use crate::layout::Layout;
use flashgen_codegen::abi::Operand;
use flashgen_codegen::{Shape, Spec};
use std::fmt::Debug;

/// A drawn launch: the forward's operands and the backward's gradients.
#[derive(Debug)]
pub(super) struct Dense {
    pub spec: usize,
    pub p: Problem,
    g: Grads,
    pub args: Vec<ArgInfo>,
}

impl Dense {
    pub fn shape(&self) -> Shape {
        let (q, k) = (&self.p.q.layout, &self.p.k.layout);
        Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, q_len: q.seq, kv_len: k.seq }
    }

    fn operands(&self) -> [(Operand, Buffer); 8] {
        let (p, g) = (&self.p, &self.g);
        [
            (Operand::Q, p.q),
            (Operand::K, p.k),
            (Operand::V, p.v),
            (Operand::O, p.o),
            (Operand::DO, g.d_o),
            (Operand::DQ, g.dq),
            (Operand::DK, g.dk),
            (Operand::DV, g.dv),
        ]
    }
}

/// `layout` in a buffer: wild draws perturb it and its length, others hold
/// it exactly.
fn buffer(rng: &mut Rng, layout: Layout, wild: bool) -> Buffer {
    match wild {
        true => {
            let layout = rng.wild(layout);
            Buffer { layout, len: rng.len(need(&layout)) }
        }
        false => Buffer { layout, len: need(&layout) },
    }
}

fn sizes(l: &Layout) -> [usize; 4] {
    [l.batch, l.seq, l.heads, l.dim]
}

/// A forward and backward launch. Well-formed draws (`!wild`) have sizes
/// within the limits, head groups, the spec's dtype and head dims, and
/// buffers that hold their layouts exactly.
pub(super) fn draw(rng: &mut Rng, specs: &[Spec], wild: bool) -> Dense {
    let spec_index = rng.below(specs.len());
    let spec = &specs[spec_index];
    let (batch, mut q_len, mut kv_len) = match wild {
        true => (rng.size(3), rng.size(6), rng.size(6)),
        false => (rng.below(4), rng.below(7), rng.below(7)),
    };
    let (heads, heads_kv) = match wild {
        true => rng.heads(),
        false => rng.pick(&[(1, 1), (2, 1), (4, 2), (6, 3), (8, 8)]),
    };
    let [qk, v] = head_dims(rng, spec, wild);
    // Self-attention over one fused projection: Q, K and V views of one buffer.
    let fused = qk == v && rng.chance(20);
    if fused {
        kv_len = q_len;
    }
    let mut shapes = [[batch, q_len, heads, qk], [batch, kv_len, heads_kv, qk], [batch, kv_len, heads_kv, v]];
    let mut o_shape = [batch, q_len, heads, v];
    if wild && rng.odd(10) {
        // One size of one operand disagrees with the others.
        let (i, axis) = (rng.below(4), rng.below(3));
        let size = rng.size(6);
        if i == 3 {
            o_shape[axis] = size
        } else {
            shapes[i][axis] = size
        }
        q_len = shapes[0][1];
    }
    let [q, k, v] = match fused {
        true => {
            let layouts = Layout::fused_qkv(batch, q_len, heads, heads_kv, qk);
            let len = layouts.iter().map(need).max().unwrap();
            let mut views = layouts.map(|l| buffer(rng, l, wild)).map(|b| Buffer { len, ..b });
            if wild {
                views.iter_mut().for_each(|b| b.len = rng.len(b.len));
            }
            views
        }
        false => shapes.map(|s| {
            let l = rng.layout(s);
            buffer(rng, l, wild)
        }),
    };
    let o = rng.layout(o_shape);
    let o = buffer(rng, o, wild);
    let rows = batch.saturating_mul(heads).saturating_mul(q_len);
    let lse = match wild {
        true => rng.opt_len(rows),
        false => rng.pick(&[None, Some(rows)]),
    };
    let p = Problem { dtype: if wild { dtype(rng, spec) } else { spec.dtype }, q, k, v, o, lse };
    // Each gradient: its counterpart's sizes, a layout of its own.
    let [d_o, dq, dk, dv] = [p.o, p.q, p.k, p.v].map(|b| {
        let l = rng.layout(sizes(&b.layout));
        buffer(rng, l, wild)
    });
    let mut dense = Dense { spec: spec_index, p, g: Grads { d_o, dq, dk, dv }, args: vec![] };
    dense.args = args(spec, &dense.shape(), wild && rng.odd(5));
    dense
}

/// What an accepted launch of `d` must hold: every operand inside its
/// buffer, the sizes the kernel indexes each operand with its own, head
/// groups, the spec's head dims, the limits, and the LSE's rows.
pub(super) fn assert_sound(d: &Dense, spec: &Spec, grads: bool, launch: Option<Shape>) {
    let case: &dyn Debug = d;
    let n = if grads { 8 } else { 4 };
    for (operand, b) in &d.operands()[..n] {
        assert_inside(&format!("{operand:?}"), &b.layout, b.len, launch.is_some(), case);
    }
    let shape = d.shape();
    let Some(launch) = launch else {
        let empty = shape.batch == 0 || (!grads && shape.q_len == 0);
        return assert!(empty, "no launch for a non-empty problem: {case:?}");
    };
    assert_eq!(launch, shape, "{case:?}");
    let (qk, v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let [q, k, vv, o] = [d.p.q, d.p.k, d.p.v, d.p.o].map(|b| sizes(&b.layout));
    let sound = [
        q == [shape.batch, shape.q_len, shape.heads, qk],
        k == [shape.batch, shape.kv_len, shape.heads_kv, qk],
        vv == [shape.batch, shape.kv_len, shape.heads_kv, v],
        o == [shape.batch, shape.q_len, shape.heads, v],
        shape.heads_kv > 0 && shape.heads.is_multiple_of(shape.heads_kv),
        within_limits(&shape),
        d.p.dtype == spec.dtype,
    ];
    assert!(sound.iter().all(|&ok| ok), "accepted an unsound launch ({sound:?}): {case:?}");
    if grads {
        let grads = [d.g.d_o, d.g.dq, d.g.dk, d.g.dv];
        for (grad, of) in grads.iter().zip([d.p.o, d.p.q, d.p.k, d.p.v]) {
            assert_eq!(sizes(&grad.layout), sizes(&of.layout), "a gradient's sizes differ: {case:?}");
        }
    }
    if let Some(len) = d.p.lse {
        let rows = shape.batch as u128 * shape.heads as u128 * shape.q_len as u128;
        assert_holds("LSE", len, rows, case);
    }
}

#[test]
fn forward_accepts_only_launches_inside_its_buffers() {
    let specs = specs();
    let check = |d: &Dense| check_forward(&specs[d.spec], &d.p, &d.args);
    wild(0xF0, 10, |rng| draw(rng, &specs, true), check, |d, launch| assert_sound(d, &specs[d.spec], false, launch));
}

#[test]
fn backward_accepts_only_launches_inside_its_buffers() {
    let specs = specs();
    let check = |d: &Dense| check_backward(&specs[d.spec], &d.p, &d.g, &d.args);
    wild(0xB0, 20, |rng| draw(rng, &specs, true), check, |d, launch| assert_sound(d, &specs[d.spec], true, launch));
}

#[test]
fn well_formed_launches_pass_and_one_element_short_does_not() {
    let (specs, mut rng) = (specs(), Rng::new(0xAC));
    for _ in 0..CASES {
        let mut d = draw(&mut rng, &specs, false);
        let spec = &specs[d.spec];
        let shape = d.shape();
        let launched = shape.batch > 0 && shape.q_len > 0;
        assert_eq!(check_forward(spec, &d.p, &d.args).unwrap(), launched.then_some(shape), "{d:?}");
        let backward = (shape.batch > 0).then_some(shape);
        assert_eq!(check_backward(spec, &d.p, &d.g, &d.args).unwrap(), backward, "{d:?}");
        // One operand's buffer one element short of its layout's last element.
        let i = rng.below(8);
        let (operand, b) = d.operands()[i];
        let Some(short) = need(&b.layout).checked_sub(1).filter(|_| !b.layout.is_empty()) else { continue };
        let fields =
            [&mut d.p.q, &mut d.p.k, &mut d.p.v, &mut d.p.o, &mut d.g.d_o, &mut d.g.dq, &mut d.g.dk, &mut d.g.dv];
        fields.into_iter().nth(i).unwrap().len = short;
        let err = check_backward(spec, &d.p, &d.g, &d.args).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: o, .. } if o == operand), "{err}: {d:?}");
    }
}
