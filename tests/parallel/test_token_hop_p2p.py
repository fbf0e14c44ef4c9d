"""The token hop's messages (`parallel/p2p.TokenHop`) between a last stage and stage 0 over
gloo on 127.0.0.1, in two spawned processes (PP = 3: the middle stage takes no part):
stage 0 gets each micro-batch's ids by request, lazily and in order, skips the micro-
batches that sample nothing, drops those past its horizon unread, and both sides stop
cleanly with messages still due; a message out of order is named; a second run on the
same ranks (micro-batch ids from 0 again, the first run's last messages unread) gets its
own ids."""
from __future__ import annotations

import traceback
from datetime import timedelta

import torch
from spawned_ranks import run_ranks


# micro-batch id -> the request ids that sample in it (plan order); 2 samples nothing
PLANS = {0: [4, 7], 1: [5], 2: [], 3: [7, 4, 9], 4: [5], 5: [4], 6: [8]}
AGAIN = {0: [4], 1: [5]}  # a second run's (a new engine on the same workers)
SECOND = 100_000  # added to the second run's ids


def _token(mb_id: int, rid: int) -> int:
    return 1000 * mb_id + rid


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from pp_runtime.parallel.groups import stage_groups
    from pp_runtime.parallel.p2p import TokenHop

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=3, timeout=timedelta(seconds=30))
        groups = stage_groups(1, 3, rank)
        hop = TokenHop(groups, torch.device("cpu"), horizon=3, timeout_s=30)
        got = []
        if rank == 2:  # the last stage: every micro-batch that samples, in order
            for mb_id, rids in PLANS.items():
                if rids:
                    hop.send(mb_id, [_token(mb_id, r) for r in rids])
            for mb_id, rids in AGAIN.items():
                hop.send(mb_id, [SECOND + _token(mb_id, r) for r in rids])
        elif rank == 0:  # stage 0 runs them all, then the ids are asked for out of order
            for mb_id, rids in PLANS.items():
                hop.before(mb_id)
                if mb_id == 4:  # its placeholders: request 4 from mb 3, then 5 from mb 1
                    got += [hop.token(3, 4), hop.token(1, 5)]
                hop.expect(mb_id, rids)
            hop.before(6)  # mbs 0-2 are past the horizon: dropped, never asked for
            got.append(sorted(hop.tokens))
            try:
                hop.token(1, 5)
            except RuntimeError as exc:
                got.append(str(exc))
            for mb_id, rids in AGAIN.items():  # mbs 4-6's messages still due, unread
                hop.before(mb_id)
                if mb_id == 1:
                    got.append(hop.token(0, 4))
                hop.expect(mb_id, rids)
        hop.close()  # stage 0 takes the messages still due; the last stage's sends complete
        out.put((rank, got))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_stage_zero_gets_each_id_lazily_in_order_and_both_sides_stop_cleanly():
    results = dict(run_ranks(_rank, 3))
    got = results[0]
    assert isinstance(got, list), got
    assert got[:2] == [_token(3, 4), _token(1, 5)]
    assert got[2] == [3]  # kept: mb 3 (read for mb 4); 0 and 1 read and then dropped
    assert "does not expect them" in got[3]
    assert got[4] == SECOND + _token(0, 4)  # the second run's own id, not the first's
    assert results[2] == [] and results[1] == []
