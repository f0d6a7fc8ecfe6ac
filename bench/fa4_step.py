#!/usr/bin/env python3
"""FlashAttention-4's training step on the suite's shape, for a profiler to
watch (scripts/gpu-stalls.sh with PEER=fa4): bf16, 16 heads, batch x
sequence length = 32768 tokens, BSHD, `iters` forward + backward calls.

    python3 fa4_step.py SEQ_LEN CAUSAL(0|1) HEAD_DIM ITERS

Needs FlashAttention-4 on PYTHONPATH (../shared/peers/fa4/README.md)."""
import sys

import torch
from flash_attn.cute.interface import flash_attn_func


def main():
    s, causal, d, iters = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
    shape = (32768 // s, s, 16, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    for _ in range(iters):
        out = flash_attn_func(q, k, v, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
