"""Configs from YAML: a path or a shipped name (`find_config`), a mapping of sections
(`config_from_dict`), a model preset by name (`load_model_config`)."""
from __future__ import annotations

import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from pp_runtime.config.sections import SECTIONS, Config, ModelConfig
from pp_runtime.config.shipped import CONFIG_DIR  # the shipped configs: configs/ at the root
from pp_runtime.core.errors import ConfigError


def _section(cls: type, data: Any, where: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return cls(**data)


def find_config(name_or_path: str | Path, kind: str = "") -> Path:
    """A YAML path as given, or a shipped config by name (e.g. 'gpt3-175b')."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidates = [CONFIG_DIR / kind / f"{name_or_path}.yaml", CONFIG_DIR / f"{name_or_path}.yaml"]
    for cand in candidates:
        if cand.is_file():
            return cand
    shipped = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(
        f"config {str(name_or_path)!r} not found: not a file, and not a shipped "
        f"{kind or 'config'} name ({', '.join(shipped) or 'none shipped'})"
    )


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    path = find_config(name_or_path, "models")
    return _section(ModelConfig, yaml.safe_load(path.read_text()), str(path))


def config_from_dict(data: dict[str, Any], where: str = "config") -> Config:
    data = dict(data or {})
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}"
        )
    model = data.get("model")
    if isinstance(model, str):  # a shipped model by name, e.g. `model: gpt3-175b`
        data["model"] = dataclasses.asdict(load_model_config(model))
    elif isinstance(model, dict) and "preset" in model:  # a shipped model with overrides
        model = dict(model)
        base = dataclasses.asdict(load_model_config(model.pop("preset")))
        data["model"] = {**base, **model}
    cfg = Config(**{s: _section(cls, data.get(s), f"{where}: {s}") for s, cls in SECTIONS.items()})
    cfg.validate()
    return cfg


def load_config(name_or_path: str | Path, **overrides: Any) -> Config:
    """Load a YAML config (a path, or a shipped name) and apply keyword overrides."""
    path = find_config(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (model:, parallel:, "
                          f"planner: ...), got a YAML {type(data).__name__}")
    cfg = config_from_dict(_beside(data, path.parent), str(path))
    return cfg.with_overrides(**overrides) if overrides else cfg


def _beside(data: dict[str, Any], here: Path) -> dict[str, Any]:
    """A relative `hardware.profile` that names a directory beside the config file is read
    from there (a shipped config carries its profile: `configs/cpu/profiles/`); any other
    relative path stays relative to where the command runs."""
    hw = data.get("hardware")
    prof = hw.get("profile") if isinstance(hw, dict) else None
    if isinstance(prof, str) and not Path(prof).is_absolute() and (here / prof).is_dir():
        data = {**data, "hardware": {**hw, "profile": str((here / prof).resolve())}}
    return data
