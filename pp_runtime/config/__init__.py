"""Configuration: what callers import (`from pp_runtime.config import Config, load_config`).

- `sections.py`: the frozen dataclasses (`ModelConfig` ... `Config`), their derived sizes
  (`seq_len`, `num_slots`, `layers_per_stage`) and `with_overrides`;
- `check.py`: `validate`, raising `ConfigError` as "section.field: problem; fix" (no I/O);
- `load.py`: YAML, a path or a shipped name (`find_config`, `load_config`,
  `config_from_dict`, `load_model_config`);
- `shipped.py`: where the shipped configs are (`CONFIG_DIR`).
"""
from pp_runtime.config.check import (FAMILIES, LAYER_SPLIT_AUTO, LAYER_SPLIT_EVEN, PLANNERS,
                                     even_split, validate)
from pp_runtime.config.load import (CONFIG_DIR, config_from_dict, find_config, load_config,
                                    load_model_config)
from pp_runtime.config.sections import (SECTIONS, CacheConfig, Config, HardwareConfig,
                                        ModelConfig, ParallelConfig, PlannerConfig,
                                        RuntimeConfig)
from pp_runtime.core.dtypes import AUTO_DTYPE, DTYPES
from pp_runtime.core.errors import CheckpointError, ConfigError
from pp_runtime.core.workload import WorkloadConfig

__all__ = [
    "AUTO_DTYPE", "CONFIG_DIR", "DTYPES", "FAMILIES", "LAYER_SPLIT_AUTO", "LAYER_SPLIT_EVEN",
    "PLANNERS", "SECTIONS", "CacheConfig", "CheckpointError", "Config", "ConfigError",
    "HardwareConfig", "ModelConfig", "ParallelConfig", "PlannerConfig", "RuntimeConfig",
    "WorkloadConfig", "config_from_dict", "even_split", "find_config", "load_config",
    "load_model_config", "validate",
]
