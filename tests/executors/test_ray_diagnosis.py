"""The Ray executor's one diagnosis (`ray_ranks.Ranks`) and its three transports
(`ray_transport.choose`), on fake actors: no Ray, no process. A rank is dead (its calls
fail at once), stopped (it answers nothing), or answers `progress` with a count; the
diagnosis names the rank the module doc says, whichever path asked."""
from types import SimpleNamespace

import pytest

from pp_runtime.core.batch import RankResult, StageTiming
from pp_runtime.core.errors import CheckpointError, WorkerFailed
from pp_runtime.executors.ray_graph import GraphPath
from pp_runtime.executors.ray_ranks import Ranks
from pp_runtime.executors.ray_relay import RelayPath
from pp_runtime.executors.ray_transport import TaskPath, choose

class Silent:
    """A ref that never becomes ready (a stopped process)."""


class Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class FakeRay:
    """`wait` and `get` over `Ref`s; a `Silent` one never comes."""

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if not isinstance(r, Silent)]
        ready = ready if num_returns > 1 else ready[:1]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref, timeout=None):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        if ref.error is not None:
            raise ref.error
        return ref.value


class FakeActor:
    """`progress`: a count (None: stopped); `dead`: every call fails; `results`: what
    `execute` returns."""

    def __init__(self, progress=0, dead=False, execute=None):
        self._count, self._dead, self._value = progress, dead, execute

    def __getattr__(self, method):
        def remote(*args):
            if self._dead:
                return Ref(error=RuntimeError("ActorDiedError: the actor died"))
            if self._count is None:
                return Silent()
            return Ref({"progress": self._count, "ping": True}.get(method, self._value))
        return SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=remote))


def ranks(*actors, tp=1):
    r = Ranks(FakeRay(), tp, len(actors) // tp, step_s=10.0)
    r.actors.extend(actors)
    return r


def test_a_stopped_rank_is_the_hung_one_even_where_another_result_is_late():
    r = ranks(FakeActor(None), FakeActor(5), FakeActor(5))
    assert r.behind(1, [1, 2]) == 0
    r = ranks(FakeActor(6), FakeActor(5), FakeActor(5))  # all answer: the late one first
    assert r.behind(1, [2]) == 2 and r.behind(1, [1, 2]) == 1
    r = ranks(FakeActor(4), FakeActor(6), FakeActor(6))  # else the one furthest behind
    assert r.behind(1, [1, 2]) == 0
    err = r.hung([1, 2], 10.0, "micro-batch 3")
    assert "stage 0 tp rank 0 did not finish micro-batch 3 within 10 s" in str(err) and r.broken


def test_a_dead_rank_is_named_before_the_neighbour_whose_error_came_back_first():
    r = ranks(FakeActor(2), FakeActor(dead=True))
    msg = str(r.failure(0, RuntimeError("gloo: connection reset"), "micro-batch 3"))
    assert msg.startswith("stage 1 tp rank 0 failed during micro-batch 3: RuntimeError: ")
    assert "seen first at stage 0 tp rank 0: RuntimeError: gloo: connection reset" in msg
    assert r.broken


def test_a_checkpoint_error_is_the_users_and_a_tp_peer_behind_rank_0_is_the_hang():
    bad = RuntimeError("raised")
    bad.cause = CheckpointError("weights missing")
    r = ranks(FakeActor(2), FakeActor(2))
    err = r.failure(1, bad, "loading weights")
    assert isinstance(err, CheckpointError) and str(err) == "stage 1 tp rank 0: weights missing"
    r = ranks(FakeActor(4), FakeActor(2), tp=2)  # TP rank 0's collective timed out on rank 1
    err = r.failure(0, RuntimeError("gloo timeout"), "micro-batch 3")
    assert "stage 0 tp rank 1 did not finish micro-batch 3 within 10 s" in str(err)
    r = ranks(FakeActor(2), FakeActor(2), tp=2)  # no peer behind: rank 0's own error
    assert str(r.failure(0, RuntimeError("x"), "m")) == "stage 0 tp rank 0 failed during m: RuntimeError: x"


def _result(rank: int, tp: int, tokens=None):
    return RankResult(StageTiming(0, rank // tp, rank % tp, 0.0, 0.0, 0.0, 1.0), tokens)


def test_each_path_is_chosen_once_and_gathers_every_rank_in_rank_order():
    cfg = lambda relay: SimpleNamespace(in_flight=3, runtime=SimpleNamespace(  # noqa: E731
        tp_relay=relay, step_timeout_s=10.0))
    two = ranks(FakeActor(), FakeActor(), FakeActor(), FakeActor(), tp=2)
    assert isinstance(choose(two, cfg(True), graph=True), GraphPath)
    assert isinstance(choose(two, cfg(True), graph=False), RelayPath)
    assert isinstance(choose(two, cfg(False), graph=False), TaskPath)
    assert isinstance(choose(ranks(FakeActor(), FakeActor()), cfg(True), graph=False), TaskPath)

    tasks = TaskPath(ranks(*(FakeActor(execute=_result(i, 2)) for i in range(4)), tp=2))
    got = tasks.gather(tasks.submit(None), 10.0, "m")
    assert [(x.timing.stage, x.timing.tp_rank) for x in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the relay: one call per stage, its TP rank 0 brings its peers' results
    leads = [FakeActor(execute=[_result(2 * s, 2), _result(2 * s + 1, 2)]) for s in range(2)]
    relay = RelayPath(ranks(leads[0], FakeActor(None), leads[1], FakeActor(None), tp=2))
    relay.start()
    assert sorted(relay.follows.values()) == [1, 3]
    got = relay.gather(relay.submit(None), 10.0, "m")
    assert [(x.timing.stage, x.timing.tp_rank) for x in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert relay.teardown(broken=True) is False and relay.follows == {}


def test_a_transport_torn_down_after_a_fault_does_not_ask_the_actors():
    r = ranks(FakeActor(), FakeActor())
    assert TaskPath(r).teardown(broken=False) and not TaskPath(r).teardown(broken=True)
    graph = GraphPath(r, 3, 10.0)
    assert graph.teardown(broken=True) is False  # never compiled: nothing to stop
    with pytest.raises(WorkerFailed, match="stage 1 tp rank 0 is dead"):
        ranks(FakeActor(), FakeActor(dead=True)).ping(1.0)
