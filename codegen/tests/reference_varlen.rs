//! The varlen reference: each packed sequence is attended to as a dense
//! batch row of its own lengths, with `b` the sequence and `q_len` /
//! `kv_len` its lengths; its LSE is `[heads, total_q]`. Its backward
//! likewise, with a shared tensor's gradient summed over the sequences.
//! Paged K/V caches gathered back are the same packed sequences.

mod support;

use flashgen_codegen::reference::{
    backward_in, backward_varlen, forward, forward_paged, forward_varlen, same_dtype_backwards_varlen, PagedProblem,
    Precision, Problem, ReferenceError, TensorData, VarlenProblem,
};
use flashgen_codegen::{parse_one, Shape, Spec};
use support::Rng;

/// Reads `b` (a per-sequence tensor), `h`, and both lengths (bottom-right
/// causal), so a sequence means what a batch row means only if all three
/// are bound per sequence.
fn spec() -> Spec {
    parse_one(
        "V { dtype: bf16, head_dim: 32, v_head_dim: 16, tensor doc: i32[B, KV_LEN], tensor slopes: f32[H], \
         mask: q + kv_len - q_len >= k && doc[b][q] == doc[b][k], score: score + slopes[h] * (k - q) as f32 }",
    )
    .unwrap()
}

const HEADS: (usize, usize) = (4, 2);

/// (queries, keys) per sequence: empty, single, odd, one much longer.
const LENS: [(usize, usize); 5] = [(0, 5), (1, 1), (7, 13), (33, 33), (90, 120)];

fn normal(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| flashgen_codegen::reference::round_bf16(rng.normal())).collect()
}

fn varlen_problem(spec: &Spec) -> VarlenProblem {
    let mut rng = Rng(7);
    let (dk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let cu = |side: fn(&(usize, usize)) -> usize| -> Vec<usize> {
        std::iter::once(0)
            .chain(LENS.iter().scan(0, |sum, len| {
                *sum += side(len);
                Some(*sum)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (cu(|l| l.0), cu(|l| l.1));
    let (total_q, total_kv) = (cu_q[LENS.len()], cu_k[LENS.len()]);
    let max_q = LENS.iter().map(|l| l.0).max().unwrap();
    let max_kv = LENS.iter().map(|l| l.1).max().unwrap();
    let shape = Shape { batch: LENS.len(), heads: HEADS.0, heads_kv: HEADS.1, q_len: max_q, kv_len: max_kv };
    // Document ids rising along each sequence's row of doc.
    let doc = (0..LENS.len() * max_kv).map(|i| ((i % max_kv) / 9) as i32).collect();
    let slopes = (0..HEADS.0).map(|h| 0.25 / (h + 1) as f64).collect();
    let problem = Problem {
        shape,
        q: normal(&mut rng, total_q * HEADS.0 * dk),
        k: normal(&mut rng, total_kv * HEADS.1 * dk),
        v: normal(&mut rng, total_kv * HEADS.1 * dv),
        scale: 0.2,
        params: vec![],
        tensors: vec![TensorData::I32(doc), TensorData::Float(slopes)],
    };
    VarlenProblem { problem, cu_seqlens_q: cu_q, cu_seqlens_k: cu_k }
}

/// Sequence `b` of `varlen` as a dense problem of one batch row: its
/// tokens, and its row of `doc` (as `doc[0]`: its `b` is then 0).
fn sequence(spec: &Spec, varlen: &VarlenProblem, b: usize) -> Problem {
    let p = &varlen.problem;
    let (dk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let (q0, q1) = (varlen.cu_seqlens_q[b], varlen.cu_seqlens_q[b + 1]);
    let (k0, k1) = (varlen.cu_seqlens_k[b], varlen.cu_seqlens_k[b + 1]);
    let (hq, hk) = HEADS;
    let TensorData::I32(doc) = &p.tensors[0] else { unreachable!() };
    let row = &doc[b * p.shape.kv_len..][..k1 - k0];
    Problem {
        shape: Shape { batch: 1, heads: hq, heads_kv: hk, q_len: q1 - q0, kv_len: k1 - k0 },
        q: p.q[q0 * hq * dk..q1 * hq * dk].to_vec(),
        k: p.k[k0 * hk * dk..k1 * hk * dk].to_vec(),
        v: p.v[k0 * hk * dv..k1 * hk * dv].to_vec(),
        tensors: vec![TensorData::I32(row.to_vec()), p.tensors[1].clone()],
        ..p.clone()
    }
}

#[test]
fn each_sequence_is_a_batch_row_of_its_own_lengths() {
    let spec = spec();
    let varlen = varlen_problem(&spec);
    for precision in [Precision::F64, Precision::SameDtype(spec.dtype)] {
        let packed = forward_varlen(&spec, &varlen, precision).unwrap();
        let (hq, dv) = (HEADS.0, spec.head_dims.v as usize);
        let total_q = varlen.cu_seqlens_q[LENS.len()];
        assert_eq!((packed.o.len(), packed.lse.len()), (total_q * hq * dv, hq * total_q));
        for b in 0..LENS.len() {
            // The dense row's b is 0, the sequence's b: doc was sliced to match.
            let dense = forward(&spec, &sequence(&spec, &varlen, b), precision).unwrap();
            let (q0, q1) = (varlen.cu_seqlens_q[b], varlen.cu_seqlens_q[b + 1]);
            assert_eq!(packed.o[q0 * hq * dv..q1 * hq * dv], dense.o[..], "O of sequence {b}");
            for h in 0..hq {
                let lse = &packed.lse[h * total_q + q0..h * total_q + q1];
                assert_eq!(lse, &dense.lse[h * (q1 - q0)..(h + 1) * (q1 - q0)], "LSE of sequence {b}, head {h}");
            }
        }
        // Every sequence has at least as many keys as queries: each row keeps
        // its bottom-right diagonal key, so no row is fully masked.
        assert!(packed.lse.iter().all(|l| l.is_finite()));
    }
}

#[test]
fn malformed_prefix_sums_are_errors() {
    let spec = spec();
    let good = varlen_problem(&spec);
    for (cu, what) in [
        (vec![0, 5, 3, 10, 20, 30], "not monotone"),
        (vec![1, 2, 3, 4, 5, 6], "not from 0"),
        (vec![0, 1, 2], "too few entries"),
        (vec![0, 0, 1, 8, 41, 200], "a sequence longer than max"),
    ] {
        let bad = VarlenProblem { cu_seqlens_q: cu, ..good.clone() };
        let err = forward_varlen(&spec, &bad, Precision::F64).unwrap_err();
        assert!(matches!(err, ReferenceError::Shape(_) | ReferenceError::Length { .. }), "{what}: {err}");
    }
}

/// `varlen`'s keys and values scattered into pages of `page_size` rows,
/// each sequence's pages in a shuffled order, with one spare page.
fn paged(spec: &Spec, varlen: &VarlenProblem, page_size: usize) -> PagedProblem {
    let p = &varlen.problem;
    let widths = [spec.head_dims.qk, spec.head_dims.v].map(|d| HEADS.1 * d as usize);
    let kv_lens: Vec<usize> = varlen.cu_seqlens_k.windows(2).map(|w| w[1] - w[0]).collect();
    let pages_per_seq = kv_lens.iter().max().unwrap().div_ceil(page_size);
    let num_pages = LENS.len() * pages_per_seq + 1;
    // Page ids reversed and interleaved across sequences: none contiguous.
    let block_table: Vec<usize> =
        (0..LENS.len() * pages_per_seq).map(|i| num_pages - 1 - (i * 7) % (num_pages - 1)).collect();
    let (mut k, mut v) = (vec![0.0; num_pages * page_size * widths[0]], vec![0.0; num_pages * page_size * widths[1]]);
    for (b, &len) in kv_lens.iter().enumerate() {
        for key in 0..len {
            let row = block_table[b * pages_per_seq + key / page_size] * page_size + key % page_size;
            let token = varlen.cu_seqlens_k[b] + key;
            for ((cache, packed), w) in [(&mut k, &p.k), (&mut v, &p.v)].into_iter().zip(widths) {
                cache[row * w..][..w].copy_from_slice(&packed[token * w..][..w]);
            }
        }
    }
    let problem = Problem { k, v, ..p.clone() };
    PagedProblem { problem, cu_seqlens_q: varlen.cu_seqlens_q.clone(), block_table, pages_per_seq, page_size, kv_lens }
}

#[test]
fn paged_caches_are_their_gathered_sequences() {
    let spec = spec();
    let varlen = varlen_problem(&spec);
    let expected = forward_varlen(&spec, &varlen, Precision::F64).unwrap();
    for page_size in [1, 3, 16, 256] {
        let paged = paged(&spec, &varlen, page_size);
        assert_eq!(forward_paged(&spec, &paged, Precision::F64).unwrap(), expected, "page_size {page_size}");
    }
    // Page ids and lengths the caches cannot hold are refused, not clamped.
    let mut bad = paged(&spec, &varlen, 16);
    bad.block_table[0] = 10_000;
    assert!(matches!(forward_paged(&spec, &bad, Precision::F64), Err(ReferenceError::Shape(_))));
    let mut bad = paged(&spec, &varlen, 16);
    bad.kv_lens[0] = bad.pages_per_seq * 16 + 1;
    assert!(matches!(forward_paged(&spec, &bad, Precision::F64), Err(ReferenceError::Shape(_))));
}

#[test]
fn each_sequence_backpropagates_as_a_batch_row_of_its_own_lengths() {
    let spec = spec();
    let varlen = varlen_problem(&spec);
    let (hq, hk, dk, dv) = (HEADS.0, HEADS.1, spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let total_q = varlen.cu_seqlens_q[LENS.len()];
    let d_out = normal(&mut Rng(11), total_q * hq * dv);
    for precision in [Precision::F64, Precision::SameDtype(spec.dtype)] {
        let packed = backward_varlen(&spec, &varlen, &d_out, precision).unwrap();
        assert!(packed.d_tensors[0].is_none(), "doc is i32: no gradient");
        let mut slopes = vec![0.0; hq];
        for b in 0..LENS.len() {
            let (q0, q1) = (varlen.cu_seqlens_q[b], varlen.cu_seqlens_q[b + 1]);
            let (k0, k1) = (varlen.cu_seqlens_k[b], varlen.cu_seqlens_k[b + 1]);
            let dense = backward_in(&spec, &sequence(&spec, &varlen, b), &d_out[q0 * hq * dv..q1 * hq * dv], precision)
                .unwrap();
            assert_eq!(packed.dq[q0 * hq * dk..q1 * hq * dk], dense.dq[..], "dQ of sequence {b}");
            assert_eq!(packed.dk[k0 * hk * dk..k1 * hk * dk], dense.dk[..], "dK of sequence {b}");
            assert_eq!(packed.dv[k0 * hk * dv..k1 * hk * dv], dense.dv[..], "dV of sequence {b}");
            for (sum, x) in slopes.iter_mut().zip(dense.d_tensors[1].as_ref().unwrap()) {
                *sum += x;
            }
        }
        // The slopes are shared by every sequence: their gradient sums them.
        let d_slopes = packed.d_tensors[1].as_ref().unwrap();
        if precision == Precision::F64 {
            for (got, want) in d_slopes.iter().zip(&slopes) {
                assert!((got - want).abs() <= 1e-9 * want.abs().max(1.0), "d_slopes {got} vs {want}");
            }
        }
    }
    // Same-dtype emulations: the first is the SameDtype backward.
    let emulated = same_dtype_backwards_varlen(&spec, &varlen, &d_out, 2).unwrap();
    assert_eq!(emulated[0], backward_varlen(&spec, &varlen, &d_out, Precision::SameDtype(spec.dtype)).unwrap());
    let err = backward_varlen(&spec, &varlen, &d_out[1..], Precision::F64).unwrap_err();
    assert!(matches!(err, ReferenceError::Length { .. }), "{err}");
}
