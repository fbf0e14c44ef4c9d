"""runtime.token_hop: where auto turns it on (executors.token_hop_on)."""
import pytest

from pp_runtime.config import Config
from pp_runtime.core.errors import ConfigError
from pp_runtime.executors import token_hop_on


def cfg(**kw):
    return Config().with_overrides(**kw)


@pytest.mark.parametrize("path, tp, on", [
    ("ray", 1, True), ("torchrun", 1, True), ("ray", 2, True), ("torchrun", 2, False),
    ("relay", 2, False),
    ("graph", 1, True), ("graph", 2, False), ("local", 1, False)])
def test_auto_is_on_where_tested(path, tp, on):
    assert token_hop_on(cfg(pp=2, tp=tp), path) is on


def test_off_without_a_pipeline_and_where_switched_off():
    assert not token_hop_on(cfg(pp=1, token_hop=True), "ray")
    assert not token_hop_on(cfg(pp=2, token_hop=False), "ray")
    assert token_hop_on(cfg(pp=2, tp=2, token_hop=True), "relay")
    assert token_hop_on(cfg(pp=2, tp=2, token_hop=True), "graph")


def test_an_unknown_value_is_refused():
    with pytest.raises(ConfigError, match="runtime.token_hop"):
        cfg(token_hop="sometimes")
