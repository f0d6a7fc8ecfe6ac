#!/usr/bin/env bash
# Profiles one forward kernel of flashgen next to SDPA's FlashAttention-2
# kernel with Nsight Compute, on a GPU machine, from a pack made by
# scripts/gpu-pack.sh (copied there as profile.sh).
#
#   profile.sh [variant] [d] [s]      (defaults: full 128 4096)
#
# Full reports go to $OUT/<name>.ncu.txt; the last lines printed compare the
# metrics that decide FlashAttention-2-class speed: tensor-pipe activity,
# issued instructions by pipe, shared-memory bank conflicts, registers,
# occupancy and the top warp stall reasons.
set -uo pipefail
source "$(dirname "$0")/env.sh"  # here, out, LD_LIBRARY_PATH, ncu
variant="${1:-full}" d="${2:-128}" s="${3:-4096}"
b=$((32768 / s))
sections=(--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
    --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis_Tables)
metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_lsu.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum

"$ncu" "${sections[@]}" --metrics "$metrics" --kernel-name regex:flashgen_fwd --launch-skip 2 --launch-count 1 \
    bin/flashgen-bench --variants "$variant" --dims "$d" --seqs "$s" --iters 3 >"$out/flashgen.ncu.txt" 2>&1
if [ "$variant" = full ] || [ "$variant" = causal ]; then
    causal=$([ "$variant" = causal ] && echo True || echo False)
    "$ncu" "${sections[@]}" --metrics "$metrics" --kernel-name regex:flash_fwd --launch-skip 2 --launch-count 1 \
        python3 -c "
import torch
from torch.nn.attention import sdpa_kernel, SDPBackend
q, k, v = (torch.randn($b, 16, $s, $d, device='cuda', dtype=torch.bfloat16) for _ in range(3))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(4):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=$causal)
torch.cuda.synchronize()
" >"$out/sdpa.ncu.txt" 2>&1
fi
summary() {
    grep -E "^  [a-z_]+(__|\.)|Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit|Executed Ipc Active|Issue Slots Busy|Stall|Shared Memory Configuration Size|Dynamic Shared" "$1" |
        sed -E 's/ +/ /g' | head -60
}
for f in "$out"/flashgen.ncu.txt "$out"/sdpa.ncu.txt; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f")"
    summary "$f"
done
