//! The example specs of `specs/`, embedded so tests, benchmarks and tools
//! run anywhere without the source tree.

/// `(file stem, source)` of every `specs/*.attn`, in a fixed order.
pub const SPECS: [(&str, &str); 14] = [
    ("full", include_str!("../../specs/full.attn")),
    ("causal", include_str!("../../specs/causal.attn")),
    ("causal_bottom_right", include_str!("../../specs/causal_bottom_right.attn")),
    ("sliding_window", include_str!("../../specs/sliding_window.attn")),
    ("prefix_lm", include_str!("../../specs/prefix_lm.attn")),
    ("longformer", include_str!("../../specs/longformer.attn")),
    ("streaming_window", include_str!("../../specs/streaming_window.attn")),
    ("document", include_str!("../../specs/document.attn")),
    ("alibi", include_str!("../../specs/alibi.attn")),
    ("softcap", include_str!("../../specs/softcap.attn")),
    ("relative_bias", include_str!("../../specs/relative_bias.attn")),
    ("gqa", include_str!("../../specs/gqa.attn")),
    ("block_sparse", include_str!("../../specs/block_sparse.attn")),
    ("sink_window", include_str!("../../specs/sink_window.attn")),
];
