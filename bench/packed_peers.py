#!/usr/bin/env python3
"""Times the peers on flashgen-bench's packed training batches, on this GPU.

What: 32768 tokens as 8 and as 64 causal documents of uneven lengths (the
lengths of `document_lengths` in tools/src/bin/flashgen-bench.rs), bf16, 16
heads, forward (and with --backward one training step: forward, then the
backward of a random dO into Q, K, V):
  flex         flex_attention with the document-causal mask over one packed
               sequence; create_block_mask's build gets a row of its own
               (wall clock with device syncs, median of 5 after a warm-up)
  sdpa-FLASH   SDPA (FlashAttention-2 backend), the documents padded to the
  sdpa-CUDNN   longest as a causal batch (the padding is computed too)
  fa4-varlen   FlashAttention-4's varlen forward (cu_seqlens), where
               flash_attn.cute imports (../shared/peers/fa4/README.md)
TFLOP/s count the kept pairs, as flashgen-bench's `pack<N>-*` rows do:
4·h·d·Σ l(l+1)/2 per forward, 3.5x that per training step.

How: python3 packed_peers.py [--dims 128,64] [--backward]
Output: rows `peer variant d s b ms TFLOP/s density` (s = 32768, b = docs).
"""
import argparse
import statistics
import sys
import time

TOKENS = 32768
HEADS = 16


def document_lengths(tokens, docs):
    weights = [100 + (i * 2654435761 % (1 << 32)) % 1900 for i in range(1, docs + 1)]
    lens = [tokens * w // sum(weights) for w in weights]
    lens[-1] += tokens - sum(lens)
    return lens


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", default="128,64")
    p.add_argument("--backward", action="store_true")
    args = p.parse_args(argv)
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    flex = torch.compile(flex_attention, dynamic=False)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {HEADS} heads, "
          f"{TOKENS} tokens as packed causal documents, do_bench median (warmup 25, rep 100)")
    print(f"{'peer':<18} {'variant':<16} {'d':>4} {'s':>6} {'b':>3} {'ms':>10} {'TFLOP/s':>9} {'density':>8}")

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def step_of(attend, tensors):
        leaves = [x.detach().requires_grad_() for x in tensors]
        d_o = torch.randn_like(attend(*leaves))

        def step():
            for x in leaves:
                x.grad = None
            attend(*leaves).backward(d_o)

        return step

    def row(peer, name, d, docs, ms, flops, dens):
        if ms is None:
            return
        print(f"{peer:<18} {name:<16} {d:>4} {TOKENS:>6} {docs:>3} {ms:>10.3f} "
              f"{flops / (ms * 1e-3) / 1e12:>9.1f} {dens:>8.4f}", flush=True)

    def timed(peer, name, d, docs, flops, dens, attend, tensors):
        for train in [False, True] if args.backward else [False]:
            label = name + ("+bwd" if train else "")
            try:
                ms = bench(step_of(attend, tensors) if train else lambda: attend(*tensors))
                row(peer, label, d, docs, ms, flops * (3.5 if train else 1.0), dens)
            except Exception as e:  # noqa: BLE001 -- one failing peer must not stop the rest
                print(f"{peer:<18} {label:<16} {d:>4} {TOKENS:>6} {docs:>3} error: {type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]}", flush=True)
            torch.cuda.empty_cache()

    for d in [int(x) for x in args.dims.split(",")]:
        for docs in (8, 64):
            lens = document_lengths(TOKENS, docs)
            kept = sum(n * (n + 1) // 2 for n in lens)
            dens, flops = kept / TOKENS ** 2, 4.0 * HEADS * d * kept
            name = f"pack{docs}"
            torch.manual_seed(docs)
            q, k, v = (torch.randn(1, HEADS, TOKENS, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

            ids = torch.repeat_interleave(torch.arange(docs, device="cuda", dtype=torch.int32),
                                          torch.tensor(lens, device="cuda"))

            def doc_causal(b, h, qi, ki):
                return (ids[qi] == ids[ki]) & (qi >= ki)

            builds = []
            for _ in range(6):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                mask = create_block_mask(doc_causal, None, None, TOKENS, TOKENS, device="cuda", BLOCK_SIZE=128)
                torch.cuda.synchronize()
                builds.append((time.perf_counter() - t0) * 1e3)
            print(f"{'create_block_mask':<18} {name + '-doc':<16} {d:>4} {TOKENS:>6} {docs:>3} "
                  f"{statistics.median(builds[1:]):>10.3f} {'-':>9} {dens:>8.4f}", flush=True)
            timed("flex", name + "-doc", d, docs, flops, dens,
                  lambda q, k, v: flex(q, k, v, block_mask=mask), (q, k, v))

            longest = max(lens)
            padded = [torch.zeros(docs, HEADS, longest, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            start = 0
            for i, n in enumerate(lens):
                for dst, src in zip(padded, (q, k, v)):
                    dst[i, :, :n] = src[0, :, start:start + n]
                start += n
            for peer, backend in (("sdpa-FLASH", SDPBackend.FLASH_ATTENTION), ("sdpa-CUDNN", SDPBackend.CUDNN_ATTENTION)):
                def sdpa(q, k, v, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                timed(peer, name + "-padded", d, docs, flops, dens, sdpa, padded)
            del padded

            if flash_attn_varlen_func is not None:
                thd = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
                cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), device="cuda",
                                  dtype=torch.int32)

                def fa4(q, k, v):
                    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                 max_seqlen_q=longest, max_seqlen_k=longest, causal=True)
                    return out[0] if isinstance(out, tuple) else out
                timed("fa4-varlen", name + "-varlen", d, docs, flops, dens, fa4, thd)
                del thd
            del q, k, v
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
