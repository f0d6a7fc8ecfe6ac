#!/usr/bin/env bash
# Runs every test of the workspace that needs no GPU. Compiling kernels needs
# NVRTC, not a GPU: nvrtc-env.sh finds a CUDA toolkit's libnvrtc or installs
# NVIDIA's PyPI wheel into target/pypi-nvrtc. The GPU tests are #[ignore]d
# (the summary counts them as ignored); on a GPU machine run them with
# `cargo test --workspace --release -- --include-ignored`, or pack them with
# scripts/gpu-pack.sh.
#
# Everything builds once, in the test profile: the CLI run below is the
# binary the tests built, with their dependency features (a `cargo run` of
# one package would resolve other features and compile dependencies again).
set -euo pipefail
source "$(dirname "$0")/nvrtc-env.sh"
cd "$flashgen_root"
cargo test --workspace --all-targets
cargo test --workspace --doc
flashgen="${CARGO_TARGET_DIR:-target}/debug/flashgen"
# flashgen-candle, a workspace of its own linked against CUDA as candle is:
# its CPU tests. Without a toolkit its binaries start against the link stubs
# (scripts/cuda-build-env.sh), which abort if a test reaches CUDA.
(
    source scripts/cuda-build-env.sh
    if [ -d "${CUDA_ROOT:-}/lib/stubs" ]; then
        export LD_LIBRARY_PATH="$CUDA_ROOT/lib/stubs:$CUDA_ROOT/lib:${LD_LIBRARY_PATH:-}"
    fi
    cd candle
    cargo test --all-targets
    cargo test --doc
)
# CUDA 12 drivers need CUDA 12's NVRTC: every shipped spec compiles with it too.
scripts/nvrtc12-check.sh "$flashgen"
# The trace harness's launch arguments (scripts/trace/harness_args.py) off
# today's traced kernels, at d = 128 (O staged in the Q buffer) and d = 64 (O
# in a buffer of its own); codegen's tests check the trace points themselves.
spec=$(mktemp --suffix=.attn)
kernel=$(mktemp --suffix=.cu)
trap 'rm -f "$spec" "$kernel"' EXIT
for entry in sliding_window:window=1024 causal:; do
    for d in 128 64; do
        sed "s/head_dim: 128/head_dim: $d/" "specs/${entry%%:*}.attn" >"$spec"
        "$flashgen" emit --trace --arch sm_90 --config wgmma.w8.m1.n128 "$spec" >"$kernel"
        python3 scripts/trace/harness_args.py "$kernel" ${entry#*:} >/dev/null
    done
done
