#!/usr/bin/env python3
"""Where a traced kernel's cycles go (scripts/trace/harness.cu's trace file).

    analyze.py TRACE_FILE

For the consumer warpgroups and the producer apart: each transition between
consecutive events of one warpgroup (a -> b), its share of that role's
traced cycles, how often it ran, and its mean length in cycles; then the
consumers' median turn-to-turn time (one tile of one warpgroup).
"""
import os
import struct
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness_args import EVENTS  # noqa: E402

NAMES = {code: name for code, name, *_ in EVENTS}
PRODUCER = 20  # event codes from here on are the producer's


def rows(path):
    data = open(path, "rb").read()
    ctas, roles, n = struct.unpack_from("3i", data)
    counts = struct.unpack_from(f"{ctas * roles}i", data, 12)
    base = 12 + 4 * ctas * roles
    for row, count in enumerate(counts):
        count = min(count, n)
        raw = struct.unpack_from(f"{count}Q", data, base + 8 * row * n)
        if raw:
            yield [(x >> 56, x & ((1 << 56) - 1)) for x in raw]


def table(title, events):
    spans, total = defaultdict(lambda: [0, 0]), 0
    for row in events:
        total += row[-1][1] - row[0][1]
        for (a, ta), (b, tb) in zip(row, row[1:]):
            span = spans[(NAMES.get(a, a), NAMES.get(b, b))]
            span[0] += tb - ta
            span[1] += 1
    print(f"{title}: {total} cycles traced")
    print(f"  {'transition':<24} {'share':>6} {'count':>7} {'mean':>7}")
    for (a, b), (cycles, count) in sorted(spans.items(), key=lambda kv: -kv[1][0]):
        if cycles >= 0.003 * total:
            print(f"  {a + ' -> ' + b:<24} {100 * cycles / total:5.1f}% {count:7d} {cycles / count:7.0f}")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: analyze.py TRACE_FILE")
    all_rows = list(rows(sys.argv[1]))
    consumers = [r for r in all_rows if r[0][0] < PRODUCER]
    items = sum(1 for r in consumers for e, _ in r if e == 1)
    table(f"consumer warpgroups ({items} items)", consumers)
    turns = []
    for row in consumers:
        times = [t for e, t in row if e == 4]
        turns += [b - a for a, b in zip(times, times[1:])]
    turns.sort()
    if turns:
        print(f"  turn to turn: median {turns[len(turns) // 2]}, p10 {turns[len(turns) // 10]}, p90 {turns[9 * len(turns) // 10]}")
    table("producer", [r for r in all_rows if r[0][0] >= PRODUCER])


if __name__ == "__main__":
    main()
