//! The typed API that `attention!` generates, checked without a GPU.

use flashgen::cudarc::driver::CudaSlice;
use flashgen::half::bf16;
use flashgen::{attention, Error, ForwardIo, Runtime};

attention! {
    /// Causal sliding window with ALiBi (Mistral/MPT style).
    pub SlidingAlibi {
        dtype: bf16, head_dim: 128,
        param window: i32,          // runtime scalar: changing it never recompiles
        tensor slopes: f32[H],      // one value per query head
        mask: q >= k && q - k < window,
        score: score + slopes[h] * (k - q) as f32,
    }

    Plain { dtype: f16, head_dim: 64 }

    Capped {
        dtype: bf16, head_dim: 96,
        param cap: f32,
        score: cap * tanh(score / cap),
    }

    BitPacked {
        dtype: bf16, head_dim: 64,
        tensor bits: i32[H, 64],
        mask: bits[h][q >> 5] >> (k & 31) & 1 == 1 && rem_euclid(k - q, 3) != 0 || !q & 1 == 0 | 0,
        score: score + (div_euclid(q ^ k, 4) | 1 << 2) as f32,
    }

    /// Sliding window with learned attention sinks (gpt-oss style): each head's
    /// `sinks[h]` is one more logit in its softmax denominator, with no value row.
    SinkWindow {
        dtype: bf16, head_dim: 64,
        param window: i32,
        tensor sinks: f32[H],
        mask: q >= k && q - k < window,
        sink: sinks[h],
    }
}

/// [`BitPacked`] as `.attn` text: the macro's tokens and a string's parse
/// alike (`&`/`|` next to `&&`/`||`, shifts, `!` on i32).
const BIT_PACKED: &str = "BitPacked {
    dtype: bf16, head_dim: 64,
    tensor bits: i32[H, 64],
    mask: bits[h][q >> 5] >> (k & 31) & 1 == 1 && rem_euclid(k - q, 3) != 0 || !q & 1 == 0 | 0,
    score: score + (div_euclid(q ^ k, 4) | 1 << 2) as f32,
}";

#[test]
fn bit_operators_mean_the_same_in_the_macro_and_in_text() {
    assert_eq!(BitPacked::spec(), &flashgen::parse_one(BIT_PACKED).unwrap());
    assert!(
        BitPacked::SOURCE
            .contains("mask: bits[h][q >> 5] >> (k & 31) & 1 == 1 && rem_euclid(k - q, 3) != 0 || !q & 1 == 0 | 0,"),
        "{}",
        BitPacked::SOURCE
    );
}

#[test]
fn a_sink_means_the_same_in_the_macro_and_in_text() {
    let text = include_str!("../specs/sink_window.attn");
    assert_eq!(SinkWindow::spec(), &flashgen::parse_one(text).unwrap());
    assert!(SinkWindow::SOURCE.contains("    sink: sinks[h],\n"), "{}", SinkWindow::SOURCE);
}

#[test]
fn source_is_canonical_and_round_trips() {
    let spec = SlidingAlibi::spec();
    assert_eq!(spec.name, "SlidingAlibi");
    assert_eq!(spec.doc, ["Causal sliding window with ALiBi (Mistral/MPT style)."]);
    assert_eq!(flashgen::to_source(spec), SlidingAlibi::SOURCE);
    assert_eq!(&flashgen::parse_one(SlidingAlibi::SOURCE).unwrap(), spec);
    assert!(SlidingAlibi::SOURCE.contains("mask: q >= k && q - k < window,"), "{}", SlidingAlibi::SOURCE);
}

#[test]
fn kernels_are_generated_per_spec() {
    for (kernel, name) in [
        (SlidingAlibi::kernel(), "flashgen_fwd_sliding_alibi"),
        (Plain::kernel(), "flashgen_fwd_plain"),
        (Capped::kernel(), "flashgen_fwd_capped"),
    ] {
        assert_eq!(kernel.name, name);
        assert!(kernel.source.contains(name));
    }
}

/// Compiling this is the test: the params struct has the declared fields with
/// their declared types, and `forward` takes bf16 buffers for a bf16 spec.
#[allow(dead_code)]
fn typed_launch(rt: &Runtime, io: ForwardIo<'_, bf16>, slopes: &CudaSlice<f32>) -> Result<(), Error> {
    SlidingAlibi::forward(rt, io, &SlidingAlibiArgs { window: 256, slopes }, &Default::default())
}

/// Autotuning takes the same typed args and buffers as `forward`.
#[allow(dead_code)]
fn typed_autotune(rt: &Runtime, io: ForwardIo<'_, bf16>, slopes: &CudaSlice<f32>) -> Result<String, Error> {
    let report = SlidingAlibi::autotune(rt, io, &SlidingAlibiArgs { window: 256, slopes }, &Default::default())?;
    Ok(report.to_string())
}

/// The varlen forward takes the same typed args, on packed buffers.
#[allow(dead_code)]
fn typed_varlen_launch(rt: &Runtime, io: flashgen::VarlenIo<'_, bf16>, slopes: &CudaSlice<f32>) -> Result<(), Error> {
    SlidingAlibi::forward_varlen(rt, io, &SlidingAlibiArgs { window: 256, slopes }, &Default::default())
}

/// The paged forward and append take the same typed args and buffers.
#[allow(dead_code)]
fn typed_paged_launch(
    rt: &Runtime,
    io: flashgen::PagedIo<'_, bf16>,
    append: flashgen::PagedAppend<'_, bf16>,
    slopes: &CudaSlice<f32>,
) -> Result<(), Error> {
    SlidingAlibi::append_paged(rt, append)?;
    SlidingAlibi::forward_paged(rt, io, &SlidingAlibiArgs { window: 256, slopes }, &Default::default())
}

#[allow(dead_code)]
fn typed_launch_without_args(rt: &Runtime, io: ForwardIo<'_, flashgen::half::f16>) -> Result<(), Error> {
    Plain::forward(rt, io, &PlainArgs, &Default::default())
}

/// The backward pass takes the same typed args and buffers of the spec's dtype.
#[allow(dead_code)]
fn typed_backward(rt: &Runtime, io: flashgen::BackwardIo<'_, bf16>, slopes: &CudaSlice<f32>) -> Result<(), Error> {
    let opts = flashgen::BackwardOptions { deterministic: true, ..Default::default() };
    SlidingAlibi::backward(rt, io, &SlidingAlibiArgs { window: 256, slopes }, &opts)
}

/// Tuning the backward's dK/dV tile takes what the backward takes.
#[allow(dead_code)]
fn typed_backward_autotune(
    rt: &Runtime,
    io: flashgen::BackwardIo<'_, bf16>,
    slopes: &CudaSlice<f32>,
) -> Result<String, Error> {
    let report =
        SlidingAlibi::autotune_backward(rt, io, &SlidingAlibiArgs { window: 256, slopes }, &Default::default())?;
    Ok(report.to_string())
}

/// So does the varlen backward, on packed buffers.
#[allow(dead_code)]
fn typed_varlen_backward(
    rt: &Runtime,
    io: flashgen::VarlenBackwardIo<'_, bf16>,
    slopes: &CudaSlice<f32>,
) -> Result<(), Error> {
    SlidingAlibi::backward_varlen(rt, io, &SlidingAlibiArgs { window: 256, slopes }, &Default::default())
}
