#!/usr/bin/env bash
# Where one flashgen kernel waits, on a GPU machine, from a pack made by
# scripts/gpu-pack.sh (copied there as stalls.sh): Nsight Compute's source
# counters and SM balance for one launch of the kernels matching KERNEL in
# a flashgen-bench run, then the instructions with the most stall samples
# (stalls.py).
#
#   KERNEL=flashgen_bwd_bench SKIP=3 stalls.sh --backward --variants doc --dims 128 --seqs 16384 --iters 1
#
# KERNEL: a regex of kernel names (default flashgen_fwd); SKIP: launches of
# it to skip first (warm-up; default 3); TOP: instructions listed (default
# 25). PEER=fa4 or PEER=cudnn profiles that peer instead (FlashAttention-4
# on PYTHONPATH as its README says), the arguments those of peer_step.py
# after its first:
#
#   PEER=fa4 KERNEL=FlashAttentionBackwardSm90 SKIP=2 stalls.sh 16384 0 128 3
#
# The samples come split by role first (stalls.py --roles). Reports go
# to $OUT (or ./gpu-logs) as one stalls-<TAG>.tgz (TAG default: the
# kernel's name pattern; the device tool brings back at most 8 files): the
# details page (stalls.txt), per instruction (sass.csv) and the run's log.
# SM balance: sm__cycles_active.avg against .max and sm__cycles_elapsed.max
# says how long SMs sat idle at the grid's end.
set -uo pipefail
source "$(dirname "$0")/env.sh"  # here, out, LD_LIBRARY_PATH, ncu
report="$(mktemp -d)/stalls"
case "${PEER:-}" in
"") target=("$here/bin/flashgen-bench") ;;
fa4 | cudnn) target=(python3 "$here/peer_step.py" "$PEER") ;;
*) echo "stalls.sh: unknown PEER=$PEER (fa4, cudnn, or unset for flashgen)" >&2; exit 2 ;;
esac
balance=sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,gpu__time_duration.sum
FLASHGEN_CACHE_DIR="$(mktemp -d)" "$ncu" --clock-control none --section WarpStateStats --section SourceCounters \
    --section LaunchStats --metrics "$balance" --kernel-name "regex:${KERNEL:-flashgen_fwd}" \
    --launch-skip "${SKIP:-3}" --launch-count 1 -o "$report" "${target[@]}" "$@" >"$out/stalls.run.txt" 2>&1
work="$(dirname "$report")"
mv "$out/stalls.run.txt" "$work/"
"$ncu" -i "$report.ncu-rep" --page details >"$work/stalls.txt" 2>&1
"$ncu" -i "$report.ncu-rep" --page source --csv --print-source sass >"$work/sass.csv" 2>&1
grep -E "flashgen_|Duration|sm__cycles|Warp Cycles Per Issued|Registers Per Thread" "$work/stalls.txt" | sed -E 's/ +/ /g'
python3 "$here/stalls.py" "$work/sass.csv" --roles --top "${TOP:-25}"
tag="${TAG:-${KERNEL:-flashgen_fwd}}"
tar -czf "$out/stalls-${tag//[^A-Za-z0-9._-]/_}.tgz" -C "$work" stalls.txt sass.csv stalls.run.txt
