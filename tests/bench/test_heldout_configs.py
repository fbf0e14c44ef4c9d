"""Every goodput setting in benchmarks/heldout/ loads and holds the KV goodput.py gives it
(pp x B contexts of max_seq_len, paged) beside its weights, as goodput.py checks before it
starts: a broken one fails here, not when a benchmark is launched."""
from pathlib import Path

import pytest

from pp_runtime.config import load_config
from pp_runtime.engine.simulate import check_memory

HELDOUT = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "heldout").glob("*.yaml"))


def test_there_are_heldout_settings():
    assert len(HELDOUT) >= 5


@pytest.mark.parametrize("path", HELDOUT, ids=lambda p: p.stem)
def test_a_heldout_setting_fits_as_goodput_runs_it(path):
    base = load_config(str(path))
    assert base.parallel.pp > 1
    check_memory(base.with_overrides(**{"cache.kv_slots": base.num_slots, "cache.paged": True}))
