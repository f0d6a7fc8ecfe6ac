//! The reference over paged K/V caches: each sequence's keys and values
//! are gathered from its pages into packed K and V, then
//! [`forward_varlen`] computes the attention, so paged and packed
//! sequences share one definition.

use super::attention::{forward_varlen, Output, Precision, Problem, VarlenProblem};
use super::eval::check_len;
use super::ReferenceError;
use crate::spec::{Shape, Spec};

/// A paged problem. `problem`'s Q is packed `[total_q, heads, d_qk]` (dense
/// queries: `cu_seqlens_q` of equal steps), its K and V the caches
/// `[num_pages, page_size, heads_kv, d]`, its shape's `batch` the number of
/// sequences and `q_len` / `kv_len` the longest sequence's. Key `k` of
/// sequence `b` is row `k % page_size` of page `block_table[b ·
/// pages_per_seq + k / page_size]`; sequence `b` has `kv_lens[b]` keys. The
/// values must be valid (the reference does not clamp as the kernels do:
/// tests clamp with `crate::paged` first).
#[derive(Clone, Debug, PartialEq)]
pub struct PagedProblem {
    pub problem: Problem,
    pub cu_seqlens_q: Vec<usize>,
    pub block_table: Vec<usize>,
    pub pages_per_seq: usize,
    pub page_size: usize,
    pub kv_lens: Vec<usize>,
}

/// Computes attention for `spec` on `paged`, as [`forward_varlen`] does on
/// the sequences' gathered keys and values.
pub fn forward_paged(spec: &Spec, paged: &PagedProblem, precision: Precision) -> Result<Output, ReferenceError> {
    forward_varlen(spec, &gather(spec, paged)?, precision)
}

/// `paged` as a varlen problem: each sequence's rows of K and V copied out
/// of its pages, back to back.
pub fn gather(spec: &Spec, paged: &PagedProblem) -> Result<VarlenProblem, ReferenceError> {
    let p = &paged.problem;
    let Shape { batch, heads_kv, .. } = p.shape;
    let (page_size, per_seq) = (paged.page_size, paged.pages_per_seq);
    check_len("block_table", paged.block_table.len(), &[batch, per_seq])?;
    check_len("kv_lens", paged.kv_lens.len(), &[batch])?;
    let widths = [spec.head_dims.qk as usize, spec.head_dims.v as usize].map(|d| heads_kv * d);
    let row_elems = widths[0].max(1) * page_size.max(1);
    let num_pages = p.k.len() / row_elems;
    check_len("k", p.k.len(), &[num_pages, page_size, widths[0]])?;
    check_len("v", p.v.len(), &[num_pages, page_size, widths[1]])?;
    let mut cu_seqlens_k = vec![0];
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for (b, &len) in paged.kv_lens.iter().enumerate() {
        if len > per_seq * page_size {
            return Err(ReferenceError::Shape(format!("kv_lens[{b}] = {len} exceeds {per_seq} pages of {page_size}")));
        }
        for key in 0..len {
            let page = paged.block_table[b * per_seq + key / page_size];
            if page >= num_pages {
                return Err(ReferenceError::Shape(format!("sequence {b} names page {page} of {num_pages}")));
            }
            let row = page * page_size + key % page_size;
            k.extend_from_slice(&p.k[row * widths[0]..(row + 1) * widths[0]]);
            v.extend_from_slice(&p.v[row * widths[1]..(row + 1) * widths[1]]);
        }
        cu_seqlens_k.push(cu_seqlens_k[b] + len);
    }
    let problem = Problem { k, v, ..p.clone() };
    Ok(VarlenProblem { problem, cu_seqlens_q: paged.cu_seqlens_q.clone(), cu_seqlens_k })
}
