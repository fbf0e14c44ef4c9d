"""The layer split the runtime chose is the one the stage workers ran, and the report says
which (issue 22). A real Ray PP=2 run of the tiny model on 127.0.0.1: `auto` (the default
where a profile exists) resolved once on the driver to an uneven split, handed to the
actors as a list; each actor reports the layers its worker holds; the report's summary
and config carry that list."""
import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray port on 127.0.0.1

import pytest  # noqa: E402

pytest.importorskip("ray")

from pp_runtime.config import load_config  # noqa: E402
from pp_runtime.costmodel import balance  # noqa: E402
from pp_runtime.engine.llm import run_workload  # noqa: E402
from pp_runtime.telemetry.report import build_report, format_summary  # noqa: E402


def test_the_chosen_split_is_what_the_stages_ran(monkeypatch, tmp_path):
    chosen = []

    def uneven(cfg):  # what the balancer would choose; never even, so a slip shows
        chosen.append([3, 1])
        return [3, 1]

    monkeypatch.setattr(balance, "auto_layer_split", uneven)
    cfg = load_config("tiny", pp=2, executor="ray", threads_per_worker=1, planner="sarathi",
                      **{"workload.num_requests": 3, "workload.max_len": 64,
                         "hardware.profile": str(tmp_path)})  # a profile: auto by default
    assert cfg.parallel.layer_split is None
    run = run_workload(cfg)
    assert chosen, "the split was never chosen"
    report = build_report(run)
    assert report["summary"]["deployment"]["layer_split"] == [3, 1]
    assert report["config"]["parallel"]["layer_split"] == [3, 1]
    assert "layer_split 3|1" in format_summary(report)
    assert all(r["finish_reason"] == "length" for r in report["requests"])


def test_an_executor_handed_an_auto_split_chooses_it_itself(monkeypatch, tmp_path):
    """A caller that builds an executor (or a stage worker) straight from a config whose
    split is still `auto` (a profile, no split: the CPU configs) gets the chosen cut, not a
    refusal."""
    from pp_runtime.executors.local import LocalExecutor

    monkeypatch.setattr(balance, "auto_layer_split", lambda cfg: [3, 1])
    cfg = load_config("tiny", pp=2, executor="local", **{"hardware.profile": str(tmp_path)})
    assert cfg.layer_split_pending
    ex = LocalExecutor(cfg)
    try:
        assert [(w.lo, w.hi) for w in ex.workers] == [(0, 3), (3, 4)]
    finally:
        ex.shutdown()
    import torch

    from pp_runtime.worker.stage import StageWorker  # a benchmark builds one straight away
    assert StageWorker(cfg, 1, torch.device("cpu")).lo == 3
