#!/usr/bin/env python3
"""Compares flashgen-bench's numbers with peers.py's, timed in the same run.

How: python3 compare.py bench.log peers.log > compare.md
(scripts/gpu-run.sh does this when PEERS=1). Needs only the standard library.

Input rows (anything else in the logs -- device lines, headers, warnings -- is skipped):
  bench.log  variant d s b ms TFLOP/s density tiles-visited   | variant d s b error: ...
  peers.log  peer variant d s b ms TFLOP/s density            | peer variant d s b error: ...
Both sides count FLOPs the same way (4·b·h·s²·d·density), so a ratio of
TFLOP/s is the inverse ratio of times; a density that differs between the two
logs is reported, since it would make the ratio meaningless.

Output (markdown): one table row per (variant, d, s) with flashgen's and each
peer's TFLOP/s and the ratios flashgen/sdpa-FLASH, flashgen/flex and
flashgen/fa4 (FlashAttention-4, where peers.py found it); the doc
block-mask build times (create_block_mask); then one line per target of issue 4:
  - full and causal >= 1.0x sdpa-FLASH at every size
  - every masked/score-mod variant (all but full) >= 1.2x flex
  - none slower than flex (every variant >= 1.0x flex)
and issue 38's longformer and sink-window >= 1.3x flex at 8k and 16k tokens,
and, for `--backward` rows (variant+bwd, forward + backward at 3.5x the
forward FLOPs), issue 5's: causal >= 1.0x sdpa-FLASH, every variant >= 1.2x flex.
each `met`, `NOT met` (with the worst cell and the count below target), or
`incomplete` when a needed number is missing or errored.
"""
import sys

PEERS = ["sdpa-FLASH", "sdpa-CUDNN", "flex", "fa4"]
FORWARD = ["full", "causal", "swa1024", "doc", "softcap-causal", "alibi-causal", "longformer", "sink-window"]
# `--backward` rows: forward + backward of one training step, 3.5x the FLOPs.
VARIANT_ORDER = FORWARD + [v + "+bwd" for v in FORWARD]


def parse(path, has_peer):
    """{(peer, variant, d, s): (tflops or None on error, density or None)} and the device line.
    flashgen's rows get peer "flashgen"."""
    rows, device = {}, ""
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError as e:
        print(f"> could not read {path}: {e}\n")
        return rows, device
    for line in lines:
        if line.startswith("device:") and not device:
            device = line[len("device:"):].strip()
        t = line.split()
        if not has_peer:
            t = ["flashgen"] + t
        if len(t) < 6 or not (is_dims(t[2]) and t[3].isdigit() and t[4].isdigit()):
            continue
        key = (t[0], t[1], t[2], int(t[3]))
        if t[5] == "error:":
            rows[key] = (None, None)
            continue
        if t[6:7] == ["-"] and t[0] != "create_block_mask":
            continue  # a dry run's row: nothing measured
        try:
            tflops = float(t[6]) if t[6] != "-" else None
            dens = float(t[7]) if len(t) > 7 else None
        except (IndexError, ValueError):
            continue
        rows[key] = (tflops, dens, float(t[5])) if t[0] == "create_block_mask" else (tflops, dens)
    return rows, device


def is_dims(x):
    """A head-dim column: `d` or `d_qk/d_v` (kept as text, e.g. 192/128)."""
    parts = x.split("/")
    return len(parts) <= 2 and all(p.isdigit() for p in parts)


def fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def main(bench_path, peers_path):
    fg, fg_dev = parse(bench_path, has_peer=False)
    pr, pr_dev = parse(peers_path, has_peer=True)
    allrows = {**fg, **pr}
    keys = sorted({k[1:] for k in allrows if k[0] != "create_block_mask"},
                  key=lambda k: (-int(k[1].split("/")[0]), k[1], VARIANT_ORDER.index(k[0]) if k[0] in VARIANT_ORDER else 99, k[0], k[2]))

    def value(peer, key):
        """TFLOP/s, or 'error', or None when not measured."""
        r = allrows.get((peer,) + key)
        if r is None:
            return None
        return "error" if r[0] is None else r[0]

    def ratio(key, peer):
        a, b = value("flashgen", key), value(peer, key)
        return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None

    print("# flashgen vs peers, same run\n")
    print(f"- flashgen-bench: {fg_dev or '(no device line)'}")
    print(f"- peers.py: {pr_dev or '(no device line)'}\n")
    print("TFLOP/s (forward, bf16, 16 heads, 32768 tokens; – not measured):\n")
    print("| variant | d | s | flashgen | " + " | ".join(PEERS) + " | ÷ sdpa-FLASH | ÷ flex | ÷ fa4 |")
    print("|---|---|---|---|" + "---|" * len(PEERS) + "---|---|---|")
    mismatched = []
    for key in keys:
        cells = [value(p, key) for p in ["flashgen"] + PEERS]
        cells = [c if isinstance(c, str) else fmt(c) for c in cells]
        ratios = [ratio(key, p) for p in ("sdpa-FLASH", "flex", "fa4")]
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells)
              + "".join(f" | {fmt(r, '.2f')}{'×' if r else ''}" for r in ratios) + " |")
        d_fg = (fg.get(("flashgen",) + key) or (None, None))[1]
        for p in PEERS:
            d_p = (pr.get((p,) + key) or (None, None))[1]
            if d_fg is not None and d_p is not None and abs(d_fg - d_p) > 1.5e-4:
                mismatched.append(f"{p} {key[0]} d={key[1]} s={key[2]}: {d_p} vs flashgen {d_fg}")

    builds = sorted((k[3], k[2], v) for k, v in pr.items() if k[0] == "create_block_mask" and len(v) == 3)
    if builds:
        seen = {}
        for s, d, v in builds:
            seen.setdefault(s, v[2])  # build time does not depend on d: first one per s
        print("\nflex `create_block_mask` build time for the doc mask (ms, median of 5 warm builds): "
              + ", ".join(f"s={s}: {ms:.2f}" for s, ms in seen.items()))
    if mismatched:
        print("\n**Density mismatch** (the two sides count different FLOPs): " + "; ".join(mismatched))

    def target(title, cells, peer, goal):
        """cells: the (variant, d, s) keys the target covers."""
        if not cells:
            return print(f"- {title}: incomplete (no rows)")
        missing = [k for k in cells if ratio(k, peer) is None]
        below = sorted((ratio(k, peer), k) for k in cells if k not in missing and ratio(k, peer) < goal)
        parts = []
        if below:
            r, k = below[0]
            parts.append(f"NOT met: {len(below)} of {len(cells)} below {goal}×, worst {r:.2f}× ({k[0]} d={k[1]} s={k[2]})")
        if missing:
            parts.append(f"incomplete: {len(missing)} of {len(cells)} without both numbers "
                         f"(e.g. {missing[0][0]} d={missing[0][1]} s={missing[0][2]})")
        if not parts:
            worst = min(ratio(k, peer) for k in cells)
            parts.append(f"met (all {len(cells)}, worst {worst:.2f}×)")
        print(f"- {title}: " + "; ".join(parts))

    fwd = [k for k in keys if not k[0].endswith("+bwd")]
    bwd = [k for k in keys if k[0].endswith("+bwd")]
    print("\nTargets (issue 4, forward):\n")
    target("full and causal ≥ 1.0× sdpa-FLASH at every size",
           [k for k in fwd if k[0] in ("full", "causal")], "sdpa-FLASH", 1.0)
    target("every masked/score-mod variant ≥ 1.2× flex",
           [k for k in fwd if k[0] != "full"], "flex", 1.2)
    target("none slower than flex", fwd, "flex", 1.0)
    global_tokens = [k for k in fwd if k[0] in ("longformer", "sink-window") and k[2] in (8192, 16384)]
    if global_tokens:
        print("\nTargets (issue 38, global tokens):\n")
        target("longformer and sink-window ≥ 1.3× flex at 8k and 16k", global_tokens, "flex", 1.3)
    if bwd:
        print("\nTargets (issue 5, forward + backward):\n")
        target("causal ≥ 1.0× sdpa-FLASH", [k for k in bwd if k[0] == "causal+bwd"], "sdpa-FLASH", 1.0)
        target("every variant ≥ 1.2× flex", [k for k in bwd if k[0] != "full+bwd"], "flex", 1.2)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
