"""PyTorch's experimental context parallelism (`context_parallel` around
`scaled_dot_product_attention`, causal, load-balanced) beside
`flashgen-bench --cp`: one process per GPU, launched by torchrun:

    python3 -m torch.distributed.run --nproc_per_node=2 bench/cp_peers.py \
        --lens 131072,524288 --iters 3

bf16, d = 128, 16 heads, batch 1, as `--cp`. Each rank starts from the
whole Q, K, V (same seed) and the context shards them. Wall time from a
barrier of all ranks to the last one's finish (median), TFLOP/s per GPU on
the kept pairs (a step counts 3.5x the forward), and efficiency against the
unsharded SDPA on rank 0's GPU in the same run, `T1 / (N * TN)`. Rank 0
prints a markdown table last.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def timed(fn, iters):
    times = []
    for _ in range(iters + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def inputs(length, heads, dim, grad):
    torch.manual_seed(0)
    shape = (1, heads, length, dim)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3)]


def run(q, k, v, backward):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backward:
        o.backward(torch.ones_like(o))


def sharded_ms(mesh, length, args, rotate, backward):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    q, k, v = inputs(length, args.heads, args.dim, False)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        local = [t.detach().requires_grad_(backward) for t in (q, k, v)]
        return timed(lambda: run(*local, backward), args.iters)


def unsharded_ms(length, args, backward):
    if dist.get_rank() != 0:
        return timed(lambda: None, args.iters)
    q, k, v = inputs(length, args.heads, args.dim, backward)
    return timed(lambda: run(q, k, v, backward), args.iters)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lens", default="131072,524288")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rotate", default="allgather,alltoall")
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world,))
    rows = []
    for length in map(int, args.lens.split(",")):
        for backward in (False, True):
            flops = 4 * args.heads * args.dim * length * (length + 1) / 2 * (3.5 if backward else 1.0)
            one = unsharded_ms(length, args, backward)
            for rotate in args.rotate.split(","):
                try:
                    ms = sharded_ms(mesh, length, args, rotate, backward)
                except Exception as e:  # an unsupported rotate method or torch version
                    if rank == 0:
                        print(f"{length} {rotate}: {type(e).__name__}: {e}", flush=True)
                    continue
                per_gpu = flops / world / (ms * 1e-3) / 1e12
                pass_ = "fwd+bwd" if backward else "fwd"
                rows.append(f"| causal | {length // 1024}k | {pass_} | {rotate} | {one:.1f} | {ms:.1f} | "
                            f"{per_gpu:.0f} | {one / (world * ms):.2f} |")
                if rank == 0:
                    print(rows[-1], flush=True)
    if rank == 0:
        print(f"\ntorch {torch.__version__}, {world} x {torch.cuda.get_device_name()}")
        print("| variant | tokens | pass | rotate | unsharded ms | sharded ms | TFLOP/s per GPU | efficiency |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
