"""The names a config accepts (config/check.py) are exactly the ones the packages build:
every planner name makes its planner, every activation name is an MLP activation, and
nothing is implemented that the config would refuse."""
from pp_runtime.config import check
from pp_runtime.model.transformer import ACTIVATIONS
from pp_runtime.planner import PLANNERS


def test_config_planner_names_are_the_planner_registry():
    assert sorted(check.PLANNERS) == sorted(PLANNERS)
    assert all(PLANNERS[name].name == name for name in check.PLANNERS)


def test_config_activation_names_are_the_model_activations():
    assert sorted(check.ACTIVATIONS) == sorted(ACTIVATIONS)
