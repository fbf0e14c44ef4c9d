"""The Ray executor's optional path: every rank's `execute` as one Ray Compiled Graph
(`runtime.compiled_graph`; docs/distributed.md). `CompiledGraphPath` is mixed into
`RayExecutor`, which holds `actors`, `cfg`, `ray`, `dag`, `dag_broken`, `_call` and `_name`."""
from __future__ import annotations

import time

from pp_runtime.core.errors import CheckpointError, ConfigError, WorkerFailed


class CompiledGraphPath:
    def _compile(self):
        """Every rank's `execute(mb)` as one compiled graph: one `execute` per micro-batch."""
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as mb:
            graph = MultiOutputNode([a.execute.bind(mb) for a in self.actors])
        return graph.experimental_compile(_max_inflight_executions=self.cfg.in_flight + 1,
                                          _submit_timeout=self.cfg.runtime.step_timeout_s)

    def _gather_graph(self, refs: list, timeout_s: float, what: str) -> list:
        """The compiled graph's results in rank order; the first rank whose result does not
        come within timeout_s is named as hung, a rank that raised or died as failed."""
        from ray.exceptions import RayChannelTimeoutError, RayTaskError

        deadline, out = time.monotonic() + timeout_s, []
        for i, ref in enumerate(refs):
            try:
                out.append(self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except RayChannelTimeoutError:
                self.dag_broken = True
                raise WorkerFailed(f"{self._name(self._behind(i))} did not finish {what} within "
                                   f"{timeout_s:g} s (runtime.step_timeout_s)") from None
            except RayTaskError as exc:  # the rank's execute raised
                self.dag_broken = True
                cause = getattr(exc, "cause", None)
                if isinstance(cause, (CheckpointError, ConfigError)):
                    raise type(cause)(f"{self._name(i)}: {cause}") from exc
                raise WorkerFailed(f"{self._name(i)} failed during {what}: "
                                   f"{type(exc).__name__}: {first_line(exc)}") from exc
            except Exception as exc:  # the graph's channels closed: a rank died
                raise self._graph_failure(exc, what) from exc
        return out

    def _behind(self, first: int) -> int:
        """The rank with the fewest micro-batches finished (the first such in rank order):
        the one that hangs, where the others wait on it or ran ahead; `first` (the first
        result that did not come) if the ranks do not answer."""
        refs = [self._call(i, "progress") for i in range(len(self.actors))]
        try:
            done = self.ray.get(refs, timeout=5)
        except Exception:
            return first
        return done.index(min(done))

    def _graph_failure(self, exc: BaseException, what: str) -> WorkerFailed:
        """WorkerFailed naming the first rank that no longer answers (a dead actor breaks
        the whole graph, so its error alone does not say which)."""
        self.dag_broken = True
        refs = [self._call(i, "ping") for i in range(len(self.actors))]
        for i, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=5)
            except Exception as dead:  # RayActorError / ActorDiedError
                return WorkerFailed(f"{self._name(i)} failed during {what}: "
                                    f"{type(dead).__name__}: {first_line(dead)}")
        return WorkerFailed(f"the compiled graph failed during {what}: "
                            f"{type(exc).__name__}: {first_line(exc)}")



def teardown(dag, broken: bool = False) -> None:
    """Stop the graph's loops on the actors and free its channels. A broken graph's
    teardown finds dead actors: Ray would log each with a traceback, after the failure
    was already reported by name, so its logger is quiet meanwhile."""
    import logging

    log = logging.getLogger("ray.dag.compiled_dag_node")
    level = log.level
    if broken:
        log.setLevel(logging.CRITICAL)
    try:
        dag.teardown()
    except Exception:  # actors already gone: nothing left to stop
        pass
    finally:
        log.setLevel(level)



def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return next((line for line in reversed(text) if line.strip()), type(exc).__name__)[:300]
