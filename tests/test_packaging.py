"""Packaging: the wheel's metadata (version, dependency ranges, extras, the console script) and the
Makefile's set-up targets (the demo without the test extra, ``make clean``)."""

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import moe_front_jax as mf

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
requirements = pytest.importorskip("packaging.requirements", reason="pytest brings packaging")
pytest.importorskip("setuptools", reason="the test extra installs setuptools to build the wheel")


def test_version_is_the_distributions():
    assert mf.__version__ == PYPROJECT["project"]["version"]
    assert "__version__" in dir(mf)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel built from a copy of the sources (no build/ or egg-info left in the repository)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("moe_front_jax", "pallas", "bridge"):
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(tmp / "dist"), str(source)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (path,) = (tmp / "dist").glob("moe_front_jax-*.whl")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        return dict(names=names, metadata=archive.read(info).decode(),
                    entry_points=archive.read(entry).decode())


def fields(metadata: str, key: str) -> list[str]:
    header = metadata.split("\n\n", 1)[0]
    return [line.split(": ", 1)[1] for line in header.splitlines() if line.startswith(key + ": ")]


@pytest.mark.timeout(60)
def test_wheel_metadata(wheel):
    meta = wheel["metadata"]
    assert fields(meta, "Name") == ["moe-front-jax"]
    assert fields(meta, "Version") == [PYPROJECT["project"]["version"]] == [mf.__version__]
    parsed = [requirements.Requirement(r) for r in fields(meta, "Requires-Dist")]
    base = {r.name: r for r in parsed if r.marker is None}
    # Ranges, not pins: the tested JAX 0.11.2 and Flax 0.12.10 on, below the next minor release.
    for name, tested, above in (("jax", "0.11.2", "0.12.0"), ("jaxlib", "0.11.2", "0.12.0"),
                                ("flax", "0.12.10", "0.13.0")):
        spec = base[name].specifier
        assert not any(s.operator == "==" for s in spec), (name, str(spec))
        assert spec.contains(tested) and spec.contains(tested.rsplit(".", 1)[0] + ".99")
        assert not spec.contains(above) and not spec.contains("0.11.1" if name != "flax" else "0.12.9")
    assert "chex" not in base and "triton" not in base
    extra = {r.name for r in parsed if r.marker is not None and r.marker.evaluate({"extra": "test"})}
    assert {"chex", "pytest", "nbclient", "setuptools"} <= extra
    classifiers = fields(meta, "Classifier")
    assert "Programming Language :: Python :: 3.12" in classifiers
    assert fields(meta, "License-Expression") == ["Apache-2.0"]
    assert "[console_scripts]\nmoe-front-demo = moe_front_jax.demo:main" in wheel["entry_points"]
    assert "moe_front_jax/demo.py" in wheel["names"]
    assert "moe_front_jax/pallas/tuning/nvidia-h200/auto.json" in wheel["names"]


def make_dry_run(target: str, tmp_path) -> str:
    """The commands ``make -n`` would run for ``target`` with a venv that does not exist yet."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed; the README's set-up runs through it")
    result = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_demo_installs_without_the_test_extra_and_make_test_with_it(tmp_path):
    demo = [line for line in make_dry_run("demo", tmp_path).splitlines() if "pip install" in line]
    assert any(line.endswith("install -q -c constraints.txt -e .") for line in demo), demo
    assert not any("[test]" in line for line in demo), demo
    test = make_dry_run("test", tmp_path)
    assert "install -q -c constraints.txt -e '.[test]'" in test and "pytest -q -n 2 tests" in test
    assert "bin/moe-front-demo" in make_dry_run("demo", tmp_path)


def test_the_set_up_pins_what_the_gpu_runs_and_the_package_takes_ranges():
    """``make`` installs the lent GPU's jax, jaxlib and flax (constraints.txt), each inside the
    range pyproject.toml gives a user's install."""
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins == {"jax": "0.11.2", "jaxlib": "0.11.2", "flax": "0.12.10"}
    project = (ROOT / "pyproject.toml").read_text()
    for name, version in pins.items():
        assert f'"{name}>={version},<' in project, name


def test_make_clean_removes_the_build_outputs(tmp_path):
    clean = make_dry_run("clean", tmp_path).split()
    for path in ("build", "dist", "*.egg-info", ".pytest_cache", str(tmp_path / "venv")):
        assert path in clean, clean
