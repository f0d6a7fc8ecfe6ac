#!/usr/bin/env bash
# A/B timing on a GPU machine, from a pack made by scripts/gpu-pack.sh
# (copied there as ab.sh): runs each benchmark binary of BINS in turn,
# ROUNDS times, every run with a fresh FLASHGEN_CACHE_DIR (the autotuner's
# disk records would otherwise carry one binary's choice into the next), and
# prints one row per (variant, d, s) with every run's TFLOP/s.
#
#   BINS="base flashgen"   bin/<name>-bench, "flashgen" is bin/flashgen-bench
#                          (put a base build's binary at bin/base-bench)
#   ARGS="--variants doc --dims 64 --iters 10"   flashgen-bench's arguments
#   ROUNDS=2               alternating rounds
#   TESTS=1                first run the GPU tests (tests.sh: TESTLIST, FILTER, LIMIT)
#   PEERS=1                last time the peers with the same ARGS
# Logs go to $OUT (or ./gpu-logs), tarred into logs.tgz; where that leaves
# more than the 8 files the device tool brings back, only logs.tgz stays.
set -uo pipefail
source "$(dirname "$0")/env.sh"  # here, out, LD_LIBRARY_PATH, ncu
cd "$here"
bins=(${BINS:-flashgen})
rounds="${ROUNDS:-2}"
args="${ARGS:-}"
bench() { [ "$1" = flashgen ] && echo bin/flashgen-bench || echo "bin/$1-bench"; }

if [ "${TESTS:-0}" = 1 ]; then
    bash "$here/tests.sh" || echo "tests FAILED"  # TESTLIST, FILTER, LIMIT, JOBS as tests.sh reads them
fi

for r in $(seq 1 "$rounds"); do
    for b in "${bins[@]}"; do
        cache="$(mktemp -d)"
        # shellcheck disable=SC2086
        FLASHGEN_CACHE_DIR="$cache" "$(bench "$b")" $args >"$out/bench-$b-$r.log" 2>&1 || echo "$b round $r FAILED"
        rm -rf "$cache"
    done
done
if [ "${PEERS:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    timeout "${PEERS_TIMEOUT:-330}" python3 peers.py $args >"$out/peers.log" 2>"$out/peers.err" ||
        echo "peers FAILED: $(tail -1 "$out/peers.err")"
fi
tar -czf "$out/logs.tgz" -C "$out" --exclude logs.tgz . 2>/dev/null

# One row per (variant, d, s): TFLOP/s of every run, binaries in BINS order,
# then cuDNN's, FA4's (where installed), flex's and FA2's with PEERS=1.
python3 - "$out" "$rounds" "${bins[@]}" <<'EOF'
import sys, os
out, rounds, bins = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows, order = {}, []
def is_dims(text):  # `d` or `d_qk/d_v`, e.g. 192/128
    parts = text.split("/")
    return len(parts) <= 2 and all(p.isdigit() for p in parts)
def row(key):
    if key not in rows:
        rows[key] = {}
        order.append(key)
    return rows[key]
for b in bins:
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"bench-{b}-{r}.log")
        for line in open(path, errors="replace") if os.path.exists(path) else []:
            t = line.split()
            if len(t) >= 6 and is_dims(t[1]) and t[2].isdigit() and t[3].isdigit():
                try:
                    row((t[0], t[1], t[2])).setdefault(b, []).append(float(t[5]))
                except ValueError:
                    pass
peers = os.path.join(out, "peers.log")
for line in open(peers, errors="replace") if os.path.exists(peers) else []:
    t = line.split()
    if len(t) >= 7 and t[0] in ("sdpa-CUDNN", "fa4", "flex", "sdpa-FLASH") and is_dims(t[2]) and t[3].isdigit():
        try:
            row((t[1], t[2], t[3]))[t[0]] = [float(t[6])]
        except ValueError:
            pass
cols = bins + [p for p in ("sdpa-CUDNN", "fa4", "flex", "sdpa-FLASH") if any(p in v for v in rows.values())]
print("| variant | d | s | " + " | ".join(cols) + " |")
print("|---|---|---|" + "---|" * len(cols))
for key in order:
    cells = [", ".join(f"{x:.1f}" for x in rows[key].get(c, [])) or "-" for c in cols]
    print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
EOF
# The summary is printed: past 8 files, the loose logs are in logs.tgz only.
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    find "$out" -maxdepth 1 -type f \( -name '*.log' -o -name peers.err \) -delete
fi
