"""A wheel install (not `-e`) works from any directory: the shipped configs (`tiny`,
`paper/*`, the model presets) and the cost model's tables come inside the package.

The wheel is built from a copy of the source (`pip wheel --no-deps --no-build-isolation`,
so nothing is written into the checkout and no index is asked), then installed with
`--no-deps` into a fresh virtualenv. Torch, Ray and the rest come from the environment
running the tests, so the test takes seconds instead of the minutes (and gigabytes) of
installing them again: a `.pth` file in the new venv adds this environment's site-packages
after its own. (`--system-site-packages` would not do: it reaches the *base* interpreter's
site-packages, which lack torch when the tests run in a venv.) The venv's own copy of
pp_runtime comes first on its path, shadowing the checkout's editable install, and the test
checks that it is the one that runs.
"""
import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "MANIFEST.in", "pp_runtime", "configs"]


def _this_environments_site_packages() -> list[str]:
    """Where this interpreter finds torch and the rest: its site-packages (a venv's own, and
    its base's when it was made with --system-site-packages) and the user site."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def _make_venv(path: Path) -> Path:
    """A venv without pip whose path ends with this environment's site-packages; returns
    its python. `site.addsitedir` also runs their .pth files, as the interpreter does for
    its own site-packages."""
    venv.create(path, system_site_packages=False, with_pip=False)
    py = path / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"import site; site.addsitedir({d!r})" for d in _this_environments_site_packages()]
    (Path(purelib) / "_pp_runtime_test_parent_env.pth").write_text("\n".join(lines) + "\n")
    return py


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtualenv with the wheel installed: its python and its pp-runtime script."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = (tmp / "dist").glob("pp_runtime-*.whl")
    py = _make_venv(tmp / "venv")
    # the venv has no pip of its own: this environment's pip installs into it (--python)
    r = subprocess.run([*pip, "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return py, tmp / "venv" / "bin" / "pp-runtime", tmp


def _run(cmd, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_the_installed_package_is_the_wheel_not_the_checkout(installed):
    py, _, tmp = installed
    r = _run([py, "-c", "import pp_runtime, json; print(json.dumps(pp_runtime.__file__))"], tmp)
    assert r.returncode == 0, r.stderr
    path = Path(json.loads(r.stdout))
    assert path.is_relative_to(tmp / "venv"), path
    assert not path.is_relative_to(REPO), path


def test_shipped_configs_load_from_the_wheel(installed):
    py, _, tmp = installed
    code = ("from pp_runtime.config import CONFIG_DIR, load_config\n"
            "cfg = load_config('paper/gpt3_tp8_pp8')\n"
            "print(CONFIG_DIR, cfg.model.name, cfg.parallel.tp, cfg.parallel.pp)\n"
            "for name in ('tiny', 'default', 'cpu/gpt2_pp2', 'paper/gpt3_tp8'): load_config(name)\n"
            "from pathlib import Path\n"  # the CPU configs' profiles ship beside them
            "from pp_runtime.costmodel.balance import resolve_layer_split\n"
            "c = resolve_layer_split(load_config('cpu/gpt2_pp2'))\n"
            "assert Path(c.hardware.profile).is_relative_to(CONFIG_DIR.resolve()), c.hardware\n"
            "from pp_runtime.config import load_model_config\n"
            "for m in ('gpt3-175b', 'llama2-70b', 'tiny-llama'): load_model_config(m)\n")
    r = _run([py, "-c", code], tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    config_dir, name, tp, pp = r.stdout.split()
    assert Path(config_dir).is_relative_to(tmp / "venv")
    assert (name, tp, pp) == ("gpt3-175b", "8", "8")


def test_pp_runtime_run_tiny_from_another_directory(installed):
    py, script, tmp = installed
    work = tmp / "elsewhere"
    work.mkdir()
    r = _run([script, "run", "--config", "tiny", "--requests", "2", "--max-tokens", "4",
              "--out", "out"], work)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["summary"]["finish_reasons"] == {"length": 2}
    assert len(report["requests"]) == 2


def test_pyproject_lists_every_package():
    """pyproject.toml lists the packages (the configs' mapping rules out a search): one
    added under pp_runtime/ and not listed would be missing from every wheel."""
    tomllib = pytest.importorskip("tomllib")
    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts)
               for p in (REPO / "pp_runtime").rglob("__init__.py")}
    assert set(setuptools_cfg["packages"]) == on_disk | {"pp_runtime.configs"}
    assert setuptools_cfg["package-dir"] == {"pp_runtime.configs": "configs"}
    assert (REPO / "configs" / "tiny.yaml").is_file() and not (REPO / "pp_runtime" / "configs").exists()
