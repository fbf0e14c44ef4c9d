"""Activations between two stages over gloo on 127.0.0.1 (`parallel/p2p.StageLink`), in two
spawned processes: a decode-sized slice travels in the header's own message (one send,
one receive), a prefill-sized one as header then slice, and both arrive bit-exact in
fp32 and bf16, the micro-batch id checked. On gloo the next header's receive is posted
as soon as one is in (`StageLink.ahead`): every header message is then `FIXED_BYTES`,
a prefill's slice between two headers still lands in its own receive, and a clean close
ends the receive posted ahead (`END`) on both sides; with `ahead` off (NCCL's way) the
header message is as long as it needs to be."""
from __future__ import annotations

import traceback
from datetime import timedelta

import pytest
import torch
from spawned_ranks import run_ranks

from pp_runtime.core.batch import MicroBatch, SeqChunk
from pp_runtime.parallel.p2p import FIXED_BYTES, ONE_MESSAGE_BYTES

HIDDEN = 64
CASES = ((3, torch.float32), (300, torch.float32), (5, torch.bfloat16))  # (tokens, dtype)
MIXED = (4, 300, 2, 500, 1)  # one link, fp32: decode, prefill, decode, prefill, decode


def _mb(mb_id: int, tokens: int) -> MicroBatch:
    return MicroBatch(mb_id, (SeqChunk(0, [0], 0, (1,) * tokens, None),))


def _hidden(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)


def _rank(rank: int, port: int, out, ahead: bool) -> None:
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

        def link_of(dtype):
            link = StageLink(groups, HIDDEN, dtype, torch.device("cpu"))
            link.ahead = ahead
            return link

        for i, (tokens, dtype) in enumerate(CASES):  # a link each, closed after its message
            link, rec = link_of(dtype), HostTimer().record()
            if rank == 0:
                link.send(_mb(i, tokens), _hidden(tokens, dtype), rec)
            else:
                got.append(bool(torch.equal(link.recv(_mb(i, tokens), rec), _hidden(tokens, dtype))))
            link.close()
        link = link_of(torch.float32)  # one link, sizes mixed, then closed
        for i, tokens in enumerate(MIXED):
            rec = HostTimer().record()
            if rank == 0:
                link.send(_mb(i, tokens), _hidden(tokens, torch.float32), rec)
            else:
                x = link.recv(_mb(i, tokens), rec)
                got.append(bool(torch.equal(x, _hidden(tokens, torch.float32))))
        link.close()
        out.put((rank, sent, got))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc(), None))


def _ahead(rank: int, port: int, out) -> None:
    _rank(rank, port, out, True)


def _not_ahead(rank: int, port: int, out) -> None:
    _rank(rank, port, out, False)


@pytest.mark.parametrize("ahead", [True, False])
def test_slices_arrive_exact_in_their_messages(ahead):
    results = dict((r, (a, b)) for r, a, b in run_ranks(_ahead if ahead else _not_ahead, 2))
    sent, _ = results[0]
    _, got = results[1]
    assert isinstance(sent, list), sent
    assert got == [True] * (len(CASES) + len(MIXED)), results[1]
    nbytes = [t * HIDDEN * d.itemsize for t, d in CASES]
    assert nbytes[1] > ONE_MESSAGE_BYTES >= max(nbytes[0], nbytes[2])
    prefill = 300 * HIDDEN
    if ahead:  # every header message FIXED_BYTES; a clean close ends with one more
        f = FIXED_BYTES
        assert sent == [f, f, f, prefill, f, f, f,
                        f, f, prefill, f, f, 500 * HIDDEN, f, f]
    else:  # decode-sized: one message of 8 header bytes + the slice; prefill-sized: header, then slice
        assert sent == [8 + nbytes[0], 8, prefill, 8 + nbytes[2],
                        8 + 4 * HIDDEN * 4, 8, prefill, 8 + 2 * HIDDEN * 4, 8, 500 * HIDDEN,
                        8 + 1 * HIDDEN * 4]
