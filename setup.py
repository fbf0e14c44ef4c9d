"""pyproject.toml holds the metadata, the dependencies and the package layout (the shipped
configs under `configs/` install as `pp_runtime.configs`). This file is here for tools and
habits that look for it: `pip install .`, `pip install -e .` and `python setup.py sdist`
all read pyproject.toml."""
from setuptools import setup

setup()
