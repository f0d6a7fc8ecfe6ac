#!/usr/bin/env bash
# Packs traced forward kernels into .gpu-pack/trace/ (git-ignored) for
# scripts/trace/run.sh on a GPU machine: each argument NAME:SPEC:CONFIG[:P=V,...]
# emits SPEC's kernel of tile config CONFIG (`flashgen emit --arch sm_90
# --config`), with the spec's params P=V, and puts clock64() trace points into
# it (scripts/trace/instrument.py). There:
#
#   SEQS="4096 16384" bash .gpu-pack/trace/run.sh
#
# builds each with nvcc (traced and untraced), times both on the bench suite's
# shape and prints where the traced one's cycles go (scripts/trace/analyze.py).
#
#   scripts/gpu-trace-pack.sh window12:window64.attn:wgmma.w12.m1.n128:window=1024
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '2,13p' "$0"; exit 2; }
out=.gpu-pack/trace
rm -rf "$out" && mkdir -p "$out"
cargo build --release -p flashgen-tools --bin flashgen
cp scripts/trace/harness.cu scripts/trace/instrument.py scripts/trace/analyze.py scripts/trace/run.sh "$out/"
for entry in "$@"; do
    IFS=: read -r name spec config params <<<"$entry"
    target/release/flashgen emit --arch sm_90 --config "$config" "$spec" >"$out/$name.plain.cu"
    # shellcheck disable=SC2086
    python3 scripts/trace/instrument.py "$out/$name.plain.cu" ${params//,/ } >"$out/$name.cu"
    rm "$out/$name.plain.cu"
    echo "$name" >>"$out/kernels"
done
ls "$out"
