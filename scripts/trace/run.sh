#!/usr/bin/env bash
# On a GPU machine, from the pack scripts/gpu-trace-pack.sh made: builds each
# traced kernel with nvcc, with and without its trace points, times both at
# each of SEQS (default "4096 16384") and writes each trace and its summary
# to $OUT (or ./trace-logs). A launch that hangs (a hand edit's deadlock) is
# killed after a minute instead of eating the device call.
set -uo pipefail
cd "$(dirname "$0")"
out="${OUT:-$PWD/trace-logs}"
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
for name in $(cat kernels); do
    for on in 1 0; do
        nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -w -DKERNEL_FILE="\"$name.cu\"" -DTRACE_ON=$on \
            harness.cu -o "h-$name-$on" >"$out/build-$name-$on.log" 2>&1 &
    done
done
wait
for name in $(cat kernels); do
    for seq in ${SEQS:-4096 16384}; do
        [ -x "h-$name-0" ] && [ -x "h-$name-1" ] || { echo "$name: build failed (see build-$name-*.log)"; continue; }
        printf '%-12s untraced  %s\n' "$name" "$(timeout 60 "./h-$name-0" "$seq" /dev/null)"
        printf '%-12s traced    %s\n' "$name" "$(timeout 60 "./h-$name-1" "$seq" "$out/$name.$seq.trace")"
        python3 analyze.py "$out/$name.$seq.trace" >"$out/$name.$seq.txt"
    done
done
