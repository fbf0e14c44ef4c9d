"""The cost-model interface planners use.

`microbatch_time(prefills, decode_kv_lens)` predicts how long one micro-batch takes on the
slowest pipeline stage: `prefills` is a list of (start, num_tokens) chunks, `decode_kv_lens`
the KV length each decode attends to. There is one implementation, the simulator's
profile-driven `costmodel.StageCostModel` (`build_cost_model(cfg)`): the cost-aware
planners price the real runtime's micro-batches with the same model that prices the
simulated ones (docs/costmodel.md).
"""
from __future__ import annotations

from typing import Protocol, Sequence


class CostModel(Protocol):
    def microbatch_time(self, prefills: Sequence[tuple[int, int]],
                        decode_kv_lens: Sequence[int]) -> float: ...
