"""Expert parallelism: each rank holds a contiguous range of routed experts; tokens travel to the
ranks owning their experts and the expert outputs travel back, through torch.distributed
all-to-all (gloo on CPU, NCCL on GPU).

Per MoE layer and step: every (token, slot) pair is sent to the owner of its expert together with
its routing weight; each rank runs its experts on what it received (through the kernel backend's
``expert_outputs``) and returns the outputs, which land back in the sender's ``[tokens, k, D]`` tensor.
The sender then sums them in increasing expert id, exactly as a single rank would, so the result
does not depend on the number of ranks (given row-independent GEMMs: batch-invariant mode).
Every rank takes part in every call, with zero rows when it has no tokens (placeholder steps).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """all_to_all of rows; bf16 rows travel as bytes (gloo moves no bf16)."""
    bf16 = tensor.dtype == torch.bfloat16
    wire = tensor.contiguous().view(torch.uint8) if bf16 else tensor.contiguous()
    out = wire.new_empty((sum(recv_counts), *wire.shape[1:]))
    dist.all_to_all_single(out, wire, recv_counts, send_counts, group=group)
    return out.view(torch.bfloat16) if bf16 else out


class ExpertParallelDispatcher:
    def __init__(self, rank: int, world_size: int, num_experts: int, group=None):
        if num_experts % world_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {world_size} ranks")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.per_rank = num_experts // world_size

    def expert_range(self) -> range:
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

    def __call__(self, moe, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        n, k = indices.shape
        d = x.shape[-1]
        flat_expert = indices.reshape(-1)
        owner = torch.div(flat_expert, self.per_rank, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        pair_token = torch.div(order, k, rounding_mode="floor")
        send_counts = torch.bincount(owner, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = _exchange(x[pair_token], send, recv, self.group)
        experts = _exchange(flat_expert[order], send, recv, self.group)
        gates = _exchange(weights.reshape(-1)[order].float(), send, recv, self.group)
        outputs = moe.local_expert_outputs(rows, torch.arange(rows.shape[0], device=rows.device), experts, gates)
        returned = _exchange(outputs, recv, send, self.group)
        routed = torch.zeros(n * k, d, dtype=x.dtype, device=x.device)
        routed[order] = returned
        return routed.view(n, k, d)
