#!/usr/bin/env bash
# Runs a pack made by scripts/gpu-pack.sh on a GPU machine: GPU tests, the
# quickstart, then the benchmark. Logs go to $OUT (or ./gpu-logs); the last
# lines printed are a summary table. The GPU tests are #[ignore]d by default
# (a plain `cargo test` has no GPU to run them on), so they run here with
# --include-ignored: one that finds no GPU fails rather than skips. Exits
# non-zero when a test, the quickstart or the benchmark failed.
# PEERS=1: after the benchmark, time the peers on the same shapes
# (peers.py $BENCH_ARGS > peers.log, its stderr in peers.err), compare them
# with the benchmark (compare.py > compare.md) and print compare.md last.
set -uo pipefail
source "$(dirname "$0")/env.sh"  # here, out, LD_LIBRARY_PATH, ncu
cd "$here"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >"$out/device.txt" 2>&1
summary=()
failed=0
for t in bin/test-*; do
    name=${t#bin/test-}
    if "$t" --include-ignored --nocapture >"$out/$name.log" 2>&1; then status=ok; else status=FAILED failed=1; fi
    counts=$(grep -Eo '[0-9]+ passed; [0-9]+ failed; [0-9]+ ignored' "$out/$name.log" | tail -1)
    summary+=("$(printf '%-28s %s (%s)' "$name" "$status" "$counts")")
done
if bin/quickstart >"$out/quickstart.log" 2>&1; then q=ok; else q=FAILED failed=1; fi
summary+=("$(printf '%-28s %s' quickstart "$q")")
# flashgen-candle's examples (packed with CANDLE=1): each checks itself.
for e in bin/candle_*; do
    [ -x "$e" ] || continue
    name=${e#bin/}
    if "$e" >"$out/$name.log" 2>&1; then status=ok; else status=FAILED failed=1; fi
    summary+=("$(printf '%-28s %s' "$name" "$status")")
done
if [ -x bin/flashgen-bench ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
    bin/flashgen-bench ${BENCH_ARGS:-} >"$out/bench.log" 2>&1 || { summary+=("bench FAILED"); failed=1; }
fi
rm -f "$out/compare.md"
if [ "${PEERS:-0}" = 1 ]; then
    timeout "${PEERS_TIMEOUT:-330}" python3 peers.py ${BENCH_ARGS:-} >"$out/peers.log" 2>"$out/peers.err" ||
        summary+=("peers FAILED: $(tail -1 "$out/peers.err")")
    python3 compare.py "$out/bench.log" "$out/peers.log" >"$out/compare.md" 2>&1 ||
        summary+=("compare FAILED")
fi
echo "== $(head -2 "$out/device.txt" | tail -1)"
printf '%s\n' "${summary[@]}"
for log in "$out"/candle_*.log; do [ -f "$log" ] && { echo "-- ${log##*/}"; tail -12 "$log"; }; done
[ -f "$out/bench.log" ] && tail -40 "$out/bench.log"
if [ -f "$out/compare.md" ]; then echo; cat "$out/compare.md"; fi
exit "$failed"
