"""Micro-batch planners: pure Python, no torch. `make_planner` picks one by name."""
from __future__ import annotations

from pp_runtime.config import Config
from pp_runtime.planner.sarathi import SarathiPlanner

PLANNERS = {"sarathi": SarathiPlanner}


def make_planner(cfg: Config) -> SarathiPlanner:
    return PLANNERS[cfg.planner.planner](cfg, eos_token_id=cfg.model.eos_token_id)
