"""Micro-batch planners: pure Python, no torch. `make_planner` picks one by name.

| name | policy |
| --- | --- |
| sarathi | one prefill chunk + decodes, tile-aligned (the paper) |
| uniform | sarathi + packing of tail chunks (the default; optional time cap) |
| orca-best | one whole prefill + decodes |
| orca-worst | whole prefills or decodes, never both |
| vllm | prefill-first with a token budget, whole prefills |
| request-level | groups of B prefilled and decoded together (FasterTransformer) |
| sarathi-serve | decodes, then started prompts, then new ones, in one C-token budget (OSDI'24) |
| gllm | decodes spread over the pp micro-batches, prefill throttled by KV and queue (SC'25) |
"""
from __future__ import annotations

from pp_runtime.config import Config
from pp_runtime.planner.base import BasePlanner
from pp_runtime.planner.cost import CostModel
from pp_runtime.planner.gllm import GllmPlanner
from pp_runtime.planner.orca import OrcaBestPlanner, OrcaWorstPlanner
from pp_runtime.planner.request_level import RequestLevelPlanner
from pp_runtime.planner.sarathi import SarathiPlanner
from pp_runtime.planner.sarathi_serve import SarathiServePlanner
from pp_runtime.planner.uniform import UniformPlanner
from pp_runtime.planner.vllm import VllmPlanner

PLANNERS: dict[str, type[BasePlanner]] = {
    cls.name: cls for cls in (SarathiPlanner, UniformPlanner, OrcaBestPlanner, OrcaWorstPlanner,
                              VllmPlanner, RequestLevelPlanner, SarathiServePlanner, GllmPlanner)
}


def make_planner(cfg: Config, cost_model: CostModel | None = None) -> BasePlanner:
    """The planner `cfg.planner.planner`; cost-aware ones (uniform with `target_ms`) price
    micro-batches with `cost_model` (default: the simulator's, `build_cost_model(cfg)`)."""
    return PLANNERS[cfg.planner.planner](cfg, cost_model)
