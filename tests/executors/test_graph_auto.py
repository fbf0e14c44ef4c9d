"""`runtime.compiled_graph: auto` (the default), decided once on the driver from the Ray
cluster's resources (`ray_graph.graph_on`, after `ray_executor.ray_device`). The rule
(`graph_pays`): on where every stage has a processor of its own for the graph's channels
to poll on, off elsewhere; true and false are taken as given. Resources are injected, as
`resolve` is tested with GPU counts."""
import pytest

from pp_runtime.config import ConfigError, load_config
from pp_runtime.executors.ray_executor import ray_device
from pp_runtime.executors.ray_graph import graph_on


def cfg(**overrides):
    return load_config("tiny", executor="ray", **overrides)


def decide(c, resources, cores=None):
    """What `_start` does: the device first, then the graph, from the same resources."""
    return graph_on(c, ray_device(c, resources), resources, cores)


@pytest.mark.parametrize("sets, resources, cores, want", [
    # CPU actors: a CPU per worker plus one for the driver
    ({"pp": 2}, {"CPU": 2}, None, False),  # this machine: 2 cores for 2 stages and a driver
    ({"pp": 2}, {"CPU": 3}, None, True),
    ({"pp": 3}, {"CPU": 3}, None, False),  # what start_ray gives pp = 3 on 2 cores
    ({"pp": 4}, {"CPU": 8}, None, True),
    ({"pp": 2, "tp": 2}, {"CPU": 4}, None, False),
    ({"pp": 2, "tp": 2}, {"CPU": 5}, None, True),
    # a local Ray declaring more CPUs than this machine has cores: the cores count
    ({"pp": 2}, {"CPU": 4}, 2, False),
    ({"pp": 2}, {"CPU": 4}, 3, True),
    # CUDA actors (a GPU per worker): on, whatever the CPUs
    ({"pp": 2}, {"CPU": 2, "GPU": 2}, None, True),
    ({"pp": 2, "tp": 2}, {"CPU": 1, "GPU": 4}, None, True),
    ({"pp": 2, "tp": 2}, {"CPU": 4, "GPU": 3}, None, False),  # too few GPUs: CPU actors
    ({"pp": 2, "device": "cpu"}, {"CPU": 2, "GPU": 2}, None, False),  # CPU by choice
    # as given
    ({"pp": 2, "compiled_graph": True}, {"CPU": 2}, 2, True),
    ({"pp": 4, "compiled_graph": False}, {"CPU": 64, "GPU": 8}, None, False),
], ids=str)
def test_auto_is_on_where_every_stage_has_a_processor(sets, resources, cores, want):
    assert decide(cfg(**sets), resources, cores) is want


def test_auto_is_the_default_and_off_for_pp2_on_this_two_core_machine():
    """What a local Ray started here gets (start_ray: max(workers, cores) logical CPUs)."""
    c = cfg(pp=2)
    assert c.runtime.compiled_graph == "auto"
    assert decide(c, {"CPU": max(2, 2)}, 2) is False
    assert decide(cfg(pp=3), {"CPU": max(3, 2)}, 2) is False


@pytest.mark.parametrize("value", ["yes", "true", 1, None])
def test_a_bad_value_names_the_field(value):
    with pytest.raises(ConfigError, match=r"runtime\.compiled_graph"):
        cfg(compiled_graph=value)
