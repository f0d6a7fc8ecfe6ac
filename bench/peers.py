#!/usr/bin/env python3
"""Times flashgen's peers on flashgen-bench's suite, on this GPU.

What: the forward pass of the peers named in ../shared/anchors.md on the same
shapes and variants as tools/src/bin/flashgen-bench.rs, so flashgen can be compared
with peers timed in the same run on the same device:
  sdpa-FLASH  F.scaled_dot_product_attention, FlashAttention-2 backend (full, causal)
  sdpa-CUDNN  the same with the cuDNN backend (full, causal)
  flex        torch.compile(flex_attention) + create_block_mask(BLOCK_SIZE=128):
              full (no mask), causal, swa1024, doc, softcap-causal, alibi-causal,
              longformer (a band of half-width BAND plus GLOBALS global rows and
              columns), sink-window (SINKS sink keys plus a causal WINDOW-key window),
              prefix-lm (the first PREFIX keys seen by every query, causal after)
  fa4         FlashAttention-4 (CuTe DSL, `flash_attn.cute.interface.flash_attn_func`,
              BSHD copies of the same inputs): full, causal, swa1024 (window
              (WINDOW - 1, 0)), swa1024-sinks (the window and a learned sink
              logit per head, `learnable_sink`; no other peer takes one),
              softcap-causal (softcap 30); only where it imports
              (../shared/peers/fa4/README.md installs it on the GPU machine and
              sets PYTHONPATH), else a `# fa4: not installed` line on stderr
plus the time create_block_mask takes to build the doc mask (row
`create_block_mask doc ...`, wall clock with device syncs, median of 5 after
one warm-up; the TFLOP/s column is `-`).

How: python3 peers.py [--variants full,causal] [--dims 128,64] [--seqs 1024,4096,16384] [--backward]
     python3 peers.py --dry-run ...   # no torch needed: prints shapes and densities only
The flags are flashgen-bench's (--iters is accepted and ignored). Needs
PyTorch with CUDA and Triton. scripts/gpu-run.sh runs it when PEERS=1 and then
feeds its output and flashgen-bench's to compare.py.

Conventions (anchors.md, and identical to flashgen-bench): bf16, 16 heads,
batch = 32768 // s, inputs torch.randn on cuda in BHSD (one draw per shape,
shared by the variants), time = median of
triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") in ms,
TFLOP/s = 4·b·h·s²·d·density / time (2·b·h·s²·(d_qk + d_v)·density for
--dims d_qk/d_v, e.g. 192/128), density = the exact kept fraction of
(q, k) pairs, computed as flashgen-bench's `inputs()` does (the doc cut points
are the same formula). The density is printed as the last column so that
compare.py can check both sides counted the same FLOPs.

--decode instead times decoding as flashgen-bench --decode does: bf16,
query / K-V heads from --decode-heads (32/8) and head dims from
--decode-dims (128), one table each, one query token, every key kept,
batch x cache length from --batches / --kv-lens; sdpa (FLASH, CUDNN and
EFFICIENT backends, enable_gqa), flex (enable_gqa, no mask) and fa4
(pack_gqa, its own split heuristic), rows
`peer decode batch kv_len ms GB/s` with GB/s = K and V bytes / time.

--backward also times one training step (forward, then backward of a
random dO into Q, K, V) per peer, as rows named `<variant>+bwd` with
3.5x the forward FLOPs.

Output: a `device:` line, a header, then one whitespace-separated row per
(peer, variant, d, s):  peer variant d s b ms TFLOP/s density
or, when a peer fails for a shape:  peer variant d s b error: <message>
"""
import argparse
import statistics
import sys
import time

TOKENS = 32768
HEADS = 16
WINDOW = 1024
DOCS = 4
BAND = 256  # longformer: the band's half-width
GLOBALS = 32  # longformer: global rows and columns
SINKS = 4  # sink-window: sink keys beside the WINDOW-key window
PREFIX = 1024  # prefix-lm: keys every query sees
VARIANTS = ["full", "causal", "swa1024", "swa1024-sinks", "doc", "softcap-causal", "alibi-causal", "longformer",
            "sink-window", "prefix-lm"]
SDPA_VARIANTS = ("full", "causal")
FA4_VARIANTS = ("full", "causal", "swa1024", "swa1024-sinks", "softcap-causal")
FA4_ONLY = ("swa1024-sinks",)  # flex's score_mod cannot add to the softmax's denominator


def doc_ids(batch, s):
    """Document id of every position, one row per sequence: DOCS sorted
    documents whose cut points are flashgen-bench's formula."""
    rows = []
    for b in range(batch):
        cuts = sorted((i * s // DOCS + (b * 7919 + i * 104729) % (s // 8)) % s for i in range(1, DOCS))
        rows.append([sum(c <= i for c in cuts) for i in range(s)])
    return rows


def density(variant, batch, s):
    """Exact fraction of (q, k) pairs the variant's mask keeps."""
    pairs = s * s
    if variant in ("causal", "softcap-causal", "alibi-causal"):
        return (s * (s + 1) // 2) / pairs
    if variant in ("swa1024", "swa1024-sinks"):
        return sum(min(q + 1, WINDOW) for q in range(s)) / pairs
    if variant == "doc":
        kept = sum(row.count(doc) ** 2 for row in doc_ids(batch, s) for doc in range(DOCS))
        return kept / (batch * pairs)
    if variant == "longformer":
        # A global row keeps every key; another its band and the global columns below it.
        return sum(s if q < GLOBALS else min(q + BAND, s - 1) - max(q - BAND, 0) + 1 + min(GLOBALS, max(q - BAND, 0))
                   for q in range(s)) / pairs
    if variant == "sink-window":
        # The window, the sinks below it, and (first rows) the sinks past the query.
        return sum(min(q + 1, WINDOW) + min(SINKS, max(q + 1 - WINDOW, 0)) + max(min(SINKS, s) - q - 1, 0)
                   for q in range(s)) / pairs
    if variant == "prefix-lm":
        return sum(max(q + 1, min(PREFIX, s)) for q in range(s)) / pairs
    return 1.0


def peers_for(variant, fa4=True):
    sdpa = ["sdpa-FLASH", "sdpa-CUDNN"] if variant in SDPA_VARIANTS else []
    flex = [] if variant in FA4_ONLY else ["flex"]
    return sdpa + flex + (["fa4"] if fa4 and variant in FA4_VARIANTS else [])


def import_fa4():
    """FlashAttention-4's `flash_attn_func`, or None (said on stderr) where
    it is not installed."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as e:  # noqa: BLE001 -- a missing or broken install only drops its rows
        print(f"# fa4: not installed ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return flash_attn_func


def first_output(out):
    """FA4 returns O, or (O, LSE) in some releases."""
    return out[0] if isinstance(out, tuple) else out


def row(peer, variant, d, s, b, rest):
    print(f"{peer:<18} {variant:<16} {d:>4} {s:>6} {b:>3} {rest}", flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dims", default="128,64")
    p.add_argument("--seqs", default="1024,4096,16384")
    p.add_argument("--iters", default=None, help="ignored (do_bench picks its own count)")
    p.add_argument("--dry-run", action="store_true", help="print shapes and densities; needs no torch")
    p.add_argument("--backward", action="store_true", help="also time forward + backward (rows <variant>+bwd)")
    p.add_argument("--decode", action="store_true", help="time decoding instead (see the module note)")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--kv-lens", default="1024,4096,16384,65536")
    p.add_argument("--decode-heads", default="32/8", help="query/K-V head pairs, each its own table")
    p.add_argument("--decode-dims", default="128")
    args, _unknown = p.parse_known_args(argv)  # flashgen-bench ignores unknown flags too
    ints = lambda text: [int(x) for x in text.split(",") if x.strip().isdigit()]
    # A head dim is `d` or `d_qk/d_v` (DeepSeek's 192/128), as flashgen-bench takes it.
    dims = [d for d in args.dims.split(",") if all(x.isdigit() for x in d.split("/")) and d.count("/") <= 1]
    variants = []
    for v in args.variants.split(","):
        if v in VARIANTS:
            variants.append(v)
        else:
            print(f"unknown variant `{v}`", file=sys.stderr)
    if args.decode:
        heads = [tuple(int(x) for x in h.split("/")) for h in args.decode_heads.split(",") if h.count("/") == 1]
        models = [(hq, hkv, d) for d in ints(args.decode_dims) for hq, hkv in heads]
        return "decode", (ints(args.batches), ints(args.kv_lens), models), None, args.dry_run, False
    return variants, dims, ints(args.seqs), args.dry_run, args.backward


DECODE_MAX_BYTES = 40 << 30  # flashgen-bench skips caches past this too


def compiled_flex(torch, flex_attention):
    """flex_attention compiled once per shape. Every (variant, shape) is a
    new graph for Dynamo: its recompile limit (8 by default) is lifted so
    flex never silently drops to its unfused eager path, and hitting it is
    an error (an `error` row) rather than a slow number."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 1000)
    for name in ("fail_on_cache_limit_hit", "fail_on_recompile_limit_hit"):
        if hasattr(cfg, name):
            setattr(cfg, name, True)
    if hasattr(cfg, "suppress_errors"):
        cfg.suppress_errors = False
    return torch.compile(flex_attention, dynamic=False)


def run_decode(batches, kv_lens, models):
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    flex = compiled_flex(torch, flex_attention)
    fa4 = import_fa4()
    backends = {"sdpa-FLASH": SDPBackend.FLASH_ATTENTION, "sdpa-CUDNN": SDPBackend.CUDNN_ATTENTION,
                "sdpa-EFFICIENT": SDPBackend.EFFICIENT_ATTENTION}

    def peers_of(q, k, v):
        peers = {name: (lambda be=be: sdpa_step(F, sdpa_kernel, be, q, k, v)) for name, be in backends.items()}
        peers["flex"] = lambda: flex(q, k, v, enable_gqa=True)
        if fa4 is not None:
            # BSHD: one query token of every head, the cache's rows.
            bshd = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))
            peers["fa4"] = lambda: fa4(*bshd, num_splits=0, pack_gqa=True)
        return peers

    for hq, hkv, d in models:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, decode: bf16, d={d}, "
              f"heads {hq}/{hkv}, q_len 1, do_bench median (warmup 25, rep 100)")
        print(f"{'peer':<18} {'row':<8} {'batch':>5} {'kv_len':>7} {'ms':>10} {'GB/s':>9}")
        decode_rows(torch, triton, peers_of, (hq, hkv, d), batches, kv_lens)
    return 0


def decode_rows(torch, triton, peers_of, model, batches, kv_lens):
    hq, hkv, d = model
    for kv in kv_lens:
        for b in batches:
            nbytes = 2 * b * kv * hkv * d * 2
            if nbytes > DECODE_MAX_BYTES:
                print(f"{'-':<18} {'decode':<8} {b:>5} {kv:>7} skipped: {nbytes >> 30} GiB of K/V", flush=True)
                continue
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, hkv, kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            peers = peers_of(q, k, v)
            for name, step in peers.items():
                try:
                    step()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    print(f"{name:<18} {'decode':<8} {b:>5} {kv:>7} {ms:>10.4f} {gbs:>9.0f}", flush=True)
                except Exception as e:  # noqa: BLE001 -- one failing peer must not stop the suite
                    msg = " ".join(str(e).split())[:200]
                    print(f"{name:<18} {'decode':<8} {b:>5} {kv:>7} error: {type(e).__name__}: {msg}", flush=True)
            del q, k, v, peers
            torch.cuda.empty_cache()


def sdpa_step(F, sdpa_kernel, backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def main(argv):
    variants, dims, seqs, dry_run, backward = parse_args(argv)
    if variants == "decode":
        if dry_run:
            print("decode rows: batches {}, kv_lens {}, (heads, K/V heads, d) {}".format(*dims))
            return 0
        return run_decode(*dims)
    if dry_run:
        print(f"device: none (dry run), bf16, {HEADS} heads, {TOKENS} tokens per batch")
        print(f"{'peer':<18} {'variant':<16} {'d':>4} {'s':>6} {'b':>3} {'ms':>10} {'TFLOP/s':>9} {'density':>8}")
        for d in dims:
            for s in seqs:
                b = max(1, TOKENS // s)
                for v in variants:
                    dens = density(v, b, s)
                    for peer in peers_for(v):
                        row(peer, v, d, s, b, f"{'-':>10} {'-':>9} {dens:>8.4f}")
        return 0
    return run(variants, dims, seqs, backward)


def run(variants, dims, seqs, backward):
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = compiled_flex(torch, flex_attention)
    fa4 = import_fa4()

    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}, triton {triton.__version__}, bf16, {HEADS} heads, "
          f"{TOKENS} tokens per batch, do_bench median (warmup 25, rep 100)")
    print(f"{'peer':<18} {'variant':<16} {'d':>4} {'s':>6} {'b':>3} {'ms':>10} {'TFLOP/s':>9} {'density':>8}")

    def bench(fn):
        fn()  # compiles (flex) or picks the kernel; errors surface here
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def training(attend, q, k, v):
        """One training step of `attend`: forward, then backward of a fixed
        random dO into fresh leaf copies of Q, K, V (grads reset each step)."""
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        d_o = []  # drawn at the first step: O has V's head dim

        def step():
            for x in leaves:
                x.grad = None
            o = attend(*leaves)
            if not d_o:
                d_o.append(torch.randn_like(o))
            o.backward(d_o[0])

        return step

    def block_mask(mask_mod, batch, s):
        return create_block_mask(mask_mod, batch, None, s, s, device="cuda", BLOCK_SIZE=128)

    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)], device="cuda", dtype=torch.float32)

    def causal(b, h, q, k):
        return q >= k

    def swa(b, h, q, k):
        return (q >= k) & (q - k < WINDOW)

    def longformer(b, h, q, k):
        return ((q - k <= BAND) & (k - q <= BAND)) | (q < GLOBALS) | (k < GLOBALS)

    def sink_window(b, h, q, k):
        return (k < SINKS) | ((q >= k) & (q - k < WINDOW))

    def prefix_lm(b, h, q, k):
        return (k < PREFIX) | (q >= k)

    def softcap(score, b, h, q, k):
        return 30.0 * torch.tanh(score / 30.0)

    def alibi(score, b, h, q, k):
        return score + slopes[h] * (k - q)

    def time_sdpa(peer, variant, q, k, v, train):
        backend = SDPBackend.FLASH_ATTENTION if peer == "sdpa-FLASH" else SDPBackend.CUDNN_ATTENTION
        is_causal = variant == "causal"

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

        with sdpa_kernel(backend):
            return bench(training(attend, q, k, v) if train else lambda: attend(q, k, v))

    def time_flex(variant, q, k, v, dens, train):
        batch, _, s, d_qk = q.shape
        d = d_qk if v.shape[-1] == d_qk else f"{d_qk}/{v.shape[-1]}"
        mask, score_mod = None, None
        if variant in ("causal", "softcap-causal", "alibi-causal"):
            mask = block_mask(causal, None, s)
        elif variant == "swa1024":
            mask = block_mask(swa, None, s)
        elif variant == "longformer":
            mask = block_mask(longformer, None, s)
        elif variant == "sink-window":
            mask = block_mask(sink_window, None, s)
        elif variant == "prefix-lm":
            mask = block_mask(prefix_lm, None, s)
        elif variant == "doc":
            docs = torch.tensor(doc_ids(batch, s), device="cuda", dtype=torch.int32)

            def same_doc(b, h, qi, ki):
                return docs[b, qi] == docs[b, ki]

            if train:  # the forward rows time the build
                mask = block_mask(same_doc, batch, s)
            else:
                times = []
                for _ in range(6):  # one warm-up, then 5 timed builds
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    mask = block_mask(same_doc, batch, s)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                build_ms = statistics.median(times[1:])
                row("create_block_mask", "doc", d, s, batch, f"{build_ms:>10.3f} {'-':>9} {dens:>8.4f}")
        if variant == "softcap-causal":
            score_mod = softcap
        elif variant == "alibi-causal":
            score_mod = alibi

        def attend(q, k, v):
            return flex(q, k, v, score_mod=score_mod, block_mask=mask)

        return bench(training(attend, q, k, v) if train else lambda: attend(q, k, v))

    def time_fa4(variant, bshd, train):
        kwargs = {"causal": variant != "full"}
        if variant in ("swa1024", "swa1024-sinks"):
            kwargs["window_size"] = (WINDOW - 1, 0)
        if variant == "swa1024-sinks":
            kwargs["learnable_sink"] = torch.randn(HEADS, device="cuda", dtype=torch.bfloat16)
        elif variant == "softcap-causal":
            kwargs["softcap"] = 30.0

        def attend(q, k, v):
            return first_output(fa4(q, k, v, **kwargs))

        return bench(training(attend, *bshd) if train else lambda: attend(*bshd))

    for d in dims:
        for s in seqs:
            batch = max(1, TOKENS // s)
            torch.manual_seed(s)
            d_qk, d_v = (int(x) for x in (d.split("/") * 2)[:2])
            q, k, v = (torch.randn(batch, HEADS, s, n, device="cuda", dtype=torch.bfloat16) for n in (d_qk, d_qk, d_v))
            bshd = [x.transpose(1, 2).contiguous() for x in (q, k, v)] if fa4 is not None else None
            for variant in variants:
                dens = density(variant, batch, s)
                flops = 2.0 * batch * HEADS * s * s * (d_qk + d_v) * dens
                for peer in peers_for(variant, fa4 is not None):
                    for train in [False, True] if backward else [False]:
                        name, step_flops = (variant + "+bwd", 3.5 * flops) if train else (variant, flops)
                        try:
                            if peer == "flex":
                                ms = time_flex(variant, q, k, v, dens, train)
                            elif peer == "fa4":
                                ms = time_fa4(variant, bshd, train)
                            else:
                                ms = time_sdpa(peer, variant, q, k, v, train)
                            tflops = step_flops / (ms * 1e-3) / 1e12
                            row(peer, name, d, s, batch, f"{ms:>10.3f} {tflops:>9.1f} {dens:>8.4f}")
                        except Exception as e:  # noqa: BLE001 -- one failing peer must not stop the suite
                            msg = " ".join(str(e).split())[:200]
                            row(peer, name, d, s, batch, f"error: {type(e).__name__}: {msg}")
                            torch.cuda.empty_cache()
            del q, k, v, bshd
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
