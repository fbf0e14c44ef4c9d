"""Activations between two stages over gloo on 127.0.0.1 (`parallel/p2p.StageLink`), in two
spawned processes: a decode-sized slice travels in the header's own message (one send,
one receive), a prefill-sized one as header then slice, and both arrive bit-exact in
fp32 and bf16, the micro-batch id checked."""
from __future__ import annotations

import traceback
from datetime import timedelta

import torch
from spawned_ranks import run_ranks

from pp_runtime.core.batch import MicroBatch, SeqChunk
from pp_runtime.parallel.p2p import ONE_MESSAGE_BYTES

HIDDEN = 64
CASES = ((3, torch.float32), (300, torch.float32), (5, torch.bfloat16))  # (tokens, dtype)


def _mb(mb_id: int, tokens: int) -> MicroBatch:
    return MicroBatch(mb_id, (SeqChunk(0, [0], 0, (1,) * tokens, None),))


def _hidden(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from pp_runtime.parallel.groups import stage_groups
    from pp_runtime.parallel.p2p import StageLink
    from pp_runtime.telemetry.timer import HostTimer

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=30))
        groups, sent = stage_groups(1, 2, rank), []
        isend = dist.isend
        dist.isend = lambda t, dst: sent.append(t.numel()) or isend(t, dst=dst)  # count messages
        got = []
        for i, (tokens, dtype) in enumerate(CASES):
            link, rec = StageLink(groups, HIDDEN, dtype, torch.device("cpu")), HostTimer().record()
            if rank == 0:
                link.send(_mb(i, tokens), _hidden(tokens, dtype), rec)
                link.flush()
            else:
                got.append(bool(torch.equal(link.recv(_mb(i, tokens), rec), _hidden(tokens, dtype))))
        out.put((rank, sent, got))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc(), None))


def test_small_slices_ride_in_the_header_message_and_all_arrive_exact():
    results = dict((r, (a, b)) for r, a, b in run_ranks(_rank, 2))
    sent, _ = results[0]
    _, got = results[1]
    assert isinstance(sent, list), sent
    assert got == [True, True, True], results[1]
    nbytes = [t * HIDDEN * d.itemsize for t, d in CASES]
    assert nbytes[1] > ONE_MESSAGE_BYTES >= max(nbytes[0], nbytes[2])
    # decode-sized: one message of 8 header bytes + the slice; prefill-sized: header, then slice
    assert sent == [8 + nbytes[0], 8, 300 * HIDDEN, 8 + nbytes[2]]
