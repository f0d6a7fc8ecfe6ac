//! Attention the way a candle model writes it without flashgen: matmuls
//! and a softmax over the whole score matrix. The baseline the op is
//! checked and timed against, and a way to run a spec's semantics on any
//! candle device.

use candle_core::{DType, Tensor, D};

/// `softmax(scale · Q Kᵀ + bias, masked) · V` for `[batch, seq, heads, dim]`
/// Q, K, V (K/V heads repeated for GQA), computed in Q's dtype with the
/// softmax in f32, as candle models do. `bias` (added to the scaled scores)
/// and `keep` (nonzero where a pair is kept; a fully masked row gives 0)
/// broadcast against `[batch, heads, q_len, kv_len]`. Returns `[batch, q_len,
/// heads, v_dim]`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    bias: Option<&Tensor>,
    keep: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (_, _, heads, _) = q.dims4()?;
    let q = q.transpose(1, 2)?.contiguous()?;
    let k = repeat_heads(&k.transpose(1, 2)?, heads)?;
    let v = repeat_heads(&v.transpose(1, 2)?, heads)?;
    let mut scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
    if let Some(bias) = bias {
        scores = scores.broadcast_add(&bias.to_dtype(DType::F32)?)?;
    }
    let p = match keep {
        None => softmax(&scores)?,
        Some(keep) => {
            let keep = keep.broadcast_as(scores.shape())?;
            let masked = keep.where_cond(&scores, &scores.ones_like()?.affine(0.0, f64::NEG_INFINITY)?)?;
            // A row with no kept key: exp(-inf - -inf) is NaN; those rows are 0.
            let p = softmax(&masked)?;
            keep.where_cond(&p, &p.zeros_like()?)?
        }
    };
    p.to_dtype(v.dtype())?.matmul(&v)?.transpose(1, 2)
}

fn softmax(scores: &Tensor) -> candle_core::Result<Tensor> {
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// `[batch, heads_kv, seq, dim]` with each head repeated for its group of
/// `heads` query heads.
fn repeat_heads(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (batch, heads_kv, seq, dim) = t.dims4()?;
    if heads_kv == heads {
        return t.contiguous();
    }
    let group = heads / heads_kv;
    t.unsqueeze(2)?.broadcast_as((batch, heads_kv, group, seq, dim))?.reshape((batch, heads, seq, dim))
}
