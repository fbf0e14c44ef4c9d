from setuptools import find_packages, setup

setup(
    name="pp_runtime",
    version="0.1.0",
    description="Pipeline-parallel LLM inference with SARATHI-style chunked prefills "
    "and decode-maximal batching",
    packages=find_packages(include=["pp_runtime", "pp_runtime.*"]),
    # the measured A100/H100 tables the cost model ships with (MIT, from Vidur; see its README)
    package_data={"pp_runtime.costmodel": ["data/*.csv", "data/*.md", "data/*.txt"]},
    include_package_data=True,
    python_requires=">=3.10",
    # torch is deliberately not listed: requirements.txt pins the CPU build and
    # requirements-gpu.txt a CUDA range; listing it here would let pip pull a CUDA build.
    install_requires=["numpy>=1.26", "pyyaml>=6.0", "safetensors>=0.4", "tqdm>=4.66", "matplotlib>=3.7"],
    entry_points={"console_scripts": ["pp-runtime = pp_runtime.cli:main"]},
)
