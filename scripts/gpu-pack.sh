#!/usr/bin/env bash
# Builds flashgen's GPU tests, benchmark, CLI and quickstart here (release),
# and packs them with the example specs into .gpu-pack/ (git-ignored), ready
# to be carried to a GPU machine that has no Rust toolchain and run there
# with .gpu-pack/run.sh (PEERS=1 also times the peers with bench/peers.py
# and compares them with bench/compare.py), or A/B-timed with .gpu-pack/ab.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=.gpu-pack
rm -rf "$pack" && mkdir -p "$pack/bin"

# Test binaries: the integration tests that need a GPU (named gpu_*; they are
# #[ignore]d, so run.sh passes --include-ignored), of the workspace cargo
# runs in.
copy_gpu_tests() {
    cargo test --release --no-run --message-format=json "$@" 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        kind = m["target"]["kind"][0]
        if kind == "test" and m["target"]["name"].startswith("gpu_"):
            print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$pack/bin/test-$name"; done
}
copy_gpu_tests --workspace

# CANDLE=1: flashgen-candle's GPU tests and examples too (its own workspace,
# linked against CUDA as candle is; slow to build the first time), with its
# `nccl` feature, so the context-parallel test comes too.
if [ "${CANDLE:-0}" = 1 ]; then
    (
        source scripts/cuda-build-env.sh
        cd candle
        pack="../$pack" copy_gpu_tests --features nccl
        cargo build --release --examples --features nccl
    )
    cp candle/target/release/examples/candle_{llama_block,train,overhead} "$pack/bin/"
fi

cargo build --release -p flashgen --example quickstart
cargo build --release -p flashgen-tools --bins
cp target/release/flashgen target/release/flashgen-bench target/release/examples/quickstart "$pack/bin/"
cp -r specs "$pack/"
cp scripts/gpu-env.sh "$pack/env.sh"
cp scripts/gpu-run.sh "$pack/run.sh"
cp scripts/gpu-tests.sh "$pack/tests.sh"
cp scripts/gpu-profile.sh "$pack/profile.sh"
cp scripts/gpu-ab.sh "$pack/ab.sh"
cp scripts/gpu-stalls.sh "$pack/stalls.sh"
cp scripts/gpu-step-kernels.sh "$pack/step_kernels.sh"
cp scripts/stalls.py "$pack/"
# A/B against another build: BASE_BENCH=path/to/its/flashgen-bench.
if [ -n "${BASE_BENCH:-}" ]; then cp "$BASE_BENCH" "$pack/bin/base-bench"; fi
# Peers timed in the same run (PEERS=1 .gpu-pack/run.sh): python, no build.
cp bench/peers.py bench/packed_peers.py bench/compare.py bench/cp_peers.py bench/peer_step.py "$pack/"
# A carry holds 64 MiB: without their symbol tables the binaries leave room
# beside them (a panic still prints its message).
strip "$pack"/bin/*
# The binaries share most of their code (and candle's embed its PTX, ~40 MB
# each): one xz stream whose window spans them all shrinks ~80 MB to a
# few, so the whole pack fits one carry. env.sh unpacks it on first use;
# binaries copied into bin/ later travel beside it.
(cd "$pack/bin" && tar cf - -- * | xz -9 -T0 >../bins.tar.xz && rm -- *)
du -sh "$pack"
