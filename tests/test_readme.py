"""README.md: its python blocks run as written, in order, and the paths it names exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of ``text``, in order (other fences, bash for one, are not run)."""
    return [body for lang, body in FENCE.findall(text) if lang == "python"]


def test_readme_python_blocks_run_in_order_on_cpu(tmp_path):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 4, "the README lost its python examples"
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks) + '\nprint("README ran")\n')
    # Eight virtual CPU devices, as the README tells its readers to set for the mesh examples.
    # TMPDIR: the checkpoint the README writes to a temporary folder lands in pytest's.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               TMPDIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.rstrip().endswith("README ran"), (
        result.stdout[-2000:] + result.stderr[-4000:]
    )


TOP = ("moe_front_jax", "pallas", "bridge", "tests", "examples", "benchmarks", "docs")
ROOT_FILES = ("SPEC.md", "Makefile", "pyproject.toml")


def named_paths(text: str) -> set[str]:
    """Repository paths the README's prose names: link targets, and words in backticks that start with
    a top-level folder or are a root file (templates such as ``pallas/<stage>/`` are left out)."""
    prose = FENCE.sub("", text)
    words = set(re.findall(r"\]\(([^)#\s]+)\)", prose))
    for span in re.findall(r"`([^`]+)`", prose):
        words.update(span.split())
    paths = set()
    for word in words:
        word = word.strip(".,;:()")
        if "://" in word or any(c in word for c in "<>*{}"):
            continue
        if "/" in word and word.split("/")[0] in TOP or word in ROOT_FILES:
            paths.add(word)
    return paths


def test_readme_names_only_paths_the_repository_has():
    paths = named_paths(README.read_text())
    assert "SPEC.md" in paths and "benchmarks/RESULTS.md" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README.md names paths the repository does not have: {missing}"
