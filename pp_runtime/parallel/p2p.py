"""Activations between pipeline stages, timed as wait and transfer separately.

Each TP rank sends only its 1/tp slice of the hidden states [T, hidden / tp] to the same
TP rank of the next stage, which all-gathers the slices inside its TP group: tp times fewer
bytes cross the inter-node link than if every rank sent the whole tensor. Receivers size
their buffers from the micro-batch (T tokens), so no shape message is needed.

A one-element header (the micro-batch id) goes first: the time until it arrives is the
wait for the previous stage (a bubble), the time from it to the gathered activations is
the transfer. A blocking receive alone would mix the two. The header also checks that
both sides agree on which micro-batch this is. On the sending side, the time blocked until
the next stage took the previous send is back-pressure (`send` returns it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pp_runtime.batch import MicroBatch
from pp_runtime.device import now
from pp_runtime.parallel.groups import StageGroups


class StageLink:
    def __init__(self, groups: StageGroups, hidden: int, dtype: torch.dtype, device: torch.device):
        self.g, self.hidden, self.dtype, self.device = groups, hidden, dtype, device
        self.width = hidden // groups.tp  # one TP rank's slice of the activations
        self._pending: list = []  # (work, tensor) of sends in flight: tensors kept alive

    def recv(self, mb: MicroBatch) -> tuple[torch.Tensor, float, float]:
        """The previous stage's activations [T, hidden], wait seconds, transfer seconds."""
        t0 = now(self.device)
        header = torch.empty(1, dtype=torch.long, device=self.device)
        dist.recv(header, src=self.g.prev_rank)
        t1 = now(self.device)
        if int(header.item()) != mb.mb_id:
            raise RuntimeError(f"stage {self.g.stage} tp rank {self.g.tp_rank}: expected "
                               f"micro-batch {mb.mb_id}, the previous stage sent {int(header.item())}")
        part = torch.empty(mb.num_tokens, self.width, dtype=self.dtype, device=self.device)  # [T, hidden / tp]
        dist.recv(part, src=self.g.prev_rank)
        if self.g.tp > 1:
            parts = [torch.empty_like(part) for _ in range(self.g.tp)]
            dist.all_gather(parts, part, group=self.g.tp_group)
            x = torch.cat(parts, dim=1)  # [T, hidden]
        else:
            x = part
        return x, t1 - t0, now(self.device) - t1

    def send(self, mb: MicroBatch, hidden: torch.Tensor) -> float:
        """Send this rank's slice of hidden [T, hidden] onward without waiting for it to be
        taken. One send may be outstanding: first wait until the previous micro-batch's send
        was taken (gloo and NCCL sends complete only when the receiver posts its receive).
        Returns the seconds blocked on that: back-pressure from the next stage."""
        t0 = now(self.device)
        self.flush()
        blocked = now(self.device) - t0
        part = hidden.narrow(1, self.g.tp_rank * self.width, self.width).contiguous()  # [T, hidden / tp]
        header = torch.tensor([mb.mb_id], dtype=torch.long, device=self.device)
        for t in (header, part):
            self._pending.append((dist.isend(t, dst=self.g.next_rank), t))
        return blocked

    def flush(self) -> None:
        """Wait until earlier sends have been taken (their buffers may then be freed)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
