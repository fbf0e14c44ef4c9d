"""Where the shipped configs are: `configs/` at the repository root, the one copy.

pyproject.toml installs that folder as the package data `pp_runtime.configs`, so a wheel or
an sdist install has them inside the package (`pp_runtime/configs/`). A checkout (an
editable install, or `PYTHONPATH=.`) has no such folder in the package: there the
repository's own `configs/` is the one beside `pp_runtime/`.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # pp_runtime/


def _config_dir() -> Path:
    installed = _PACKAGE / "configs"  # a wheel or sdist install
    return installed if installed.is_dir() else _PACKAGE.parent / "configs"  # a checkout


CONFIG_DIR = _config_dir()
