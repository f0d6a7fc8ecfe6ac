#!/usr/bin/env bash
# Where a training step's time goes, kernel by kernel, for flashgen and its
# peers, on a GPU machine, from a pack made by scripts/gpu-pack.sh (copied
# there as step_kernels.sh): Nsight Compute times every launch of a few
# steps (gpu__time_duration, clocks free, caches flushed before each
# launch as the timed runs flush L2) and the table gives each kernel's
# median per launch and the sum of those medians (for the peers the
# script's other kernels too: its inputs drawn, once per tensor).
#
#   step_kernels.sh VARIANT D SEQ [PEERS]   e.g. step_kernels.sh causal 128 1024 "fa4 cudnn"
#
# VARIANT: full or causal. PEERS: peer_step.py's (fa4 needs FlashAttention-4
# on PYTHONPATH, as env.sh sets it where installed). Raw CSVs go to $OUT (or
# ./gpu-logs) as step-<who>-<variant>-<d>-<seq>.csv.
set -uo pipefail
source "$(dirname "$0")/env.sh"  # here, out, LD_LIBRARY_PATH, ncu
cd "$here"
variant="${1:?usage: step_kernels.sh full|causal D SEQ [PEERS]}" d="${2:?}" s="${3:?}" peers="${4:-}"
causal=$([ "$variant" = causal ] && echo 1 || echo 0)
tag="$variant-$d-$s"
profile() {  # who, kernel regex, launches to skip, launches to time, command...
    local who=$1 kernels=$2 skip=$3 count=$4
    shift 4
    FLASHGEN_CACHE_DIR="$(mktemp -d)" "$ncu" --clock-control none --cache-control all --csv \
        --metrics gpu__time_duration.sum --kernel-name "regex:$kernels" --launch-skip "$skip" \
        --launch-count "$count" "$@" >"$out/step-$who-$tag.csv" 2>"$out/step-$who-$tag.err" ||
        echo "$who: ncu FAILED: $(tail -1 "$out/step-$who-$tag.err")"
}
# flashgen-bench times the forward row first, then the step: its forward
# kernel is the step's, so every launch counts.
profile flashgen flashgen_ 0 400 bin/flashgen-bench --backward --variants "$variant" --dims "$d" --seqs "$s" --iters 1
for peer in $peers; do
    profile "$peer" . 0 400 python3 peer_step.py "$peer" "$s" "$causal" "$d" 12
done
python3 - "$out" "$tag" flashgen $peers <<'PY'
import csv, statistics, sys
out, tag, whos = sys.argv[1], sys.argv[2], sys.argv[3:]
for who in whos:
    times = {}
    try:
        rows = [r for r in csv.reader(open(f"{out}/step-{who}-{tag}.csv")) if len(r) > 10]
    except OSError:
        continue
    head = rows[0]
    name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
    for r in rows[1:]:
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[r[unit]]
        times.setdefault(r[name], []).append(float(r[value].replace(",", "")) * scale)
    print(f"== {who}, {tag} (median µs per launch, launches seen)")
    total = 0.0
    for kernel, ts in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
        med = statistics.median(ts)
        if med < 2.0:
            continue
        total += med
        print(f"{med:10.1f}  {len(ts):3d}  {kernel[:110]}")
    print(f"{total:10.1f}  sum of the medians above")
PY
