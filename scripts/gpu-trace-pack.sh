#!/usr/bin/env bash
# Packs traced forward kernels into .gpu-pack/trace/ (git-ignored) for
# scripts/trace/run.sh on a GPU machine: each argument NAME:SPEC:CONFIG[:P=V,...]
# emits SPEC's kernel of tile config CONFIG with its clock64() trace points
# (`flashgen emit --trace --arch sm_90 --config`) and the harness's launch
# arguments for the spec's params P=V (scripts/trace/harness_args.py). There:
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
cp scripts/trace/harness.cu scripts/trace/harness_args.py scripts/trace/analyze.py scripts/trace/run.sh "$out/"
for entry in "$@"; do
    IFS=: read -r name spec config params <<<"$entry"
    target/release/flashgen emit --trace --arch sm_90 --config "$config" "$spec" >"$out/$name.cu"
    # shellcheck disable=SC2086
    args=$(python3 scripts/trace/harness_args.py "$out/$name.cu" ${params//,/ })
    echo "$args" >>"$out/$name.cu"
    echo "$name" >>"$out/kernels"
done
ls "$out"
