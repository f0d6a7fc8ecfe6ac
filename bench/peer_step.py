#!/usr/bin/env python3
"""One peer's training step on the suite's shape, for a profiler to watch
(scripts/gpu-stalls.sh with PEER=..., scripts/gpu-step-kernels.sh): bf16,
16 heads, batch x sequence length = 32768 tokens, `iters` forward +
backward calls.

    python3 peer_step.py PEER SEQ_LEN CAUSAL(0|1) HEAD_DIM ITERS

PEER: `fa4` (FlashAttention-4, BSHD; needs it on PYTHONPATH, see
../shared/peers/fa4/README.md) or `cudnn` (PyTorch SDPA's cuDNN backend,
BHSD as SDPA takes it)."""
import sys

import torch


def attend(peer, causal):
    if peer == "fa4":
        from flash_attn.cute.interface import flash_attn_func

        def fa4(q, k, v):
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        return fa4, lambda b, s, d: (b, s, 16, d)
    if peer == "cudnn":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return cudnn, lambda b, s, d: (b, 16, s, d)
    sys.exit(f"peer_step.py: unknown peer {peer!r} (fa4, cudnn)")


def main():
    peer, s, causal, d, iters = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
    step, shape_of = attend(peer, causal)
    shape = shape_of(32768 // s, s, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    for _ in range(iters):
        q.grad = k.grad = v.grad = None  # as peers.py's steps: no gradient accumulation kernels
        step(q, k, v).backward(grad)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
