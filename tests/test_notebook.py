"""examples/equivalence.ipynb: committed without outputs, and executed here so it never goes stale."""

import json
import sys
from pathlib import Path

import pytest

# The test extra installs these; the lent GPU's image has none of them, and `pytest -m gpu` there
# must still collect this module.
WHY = "the notebook tests need the test extra (pip install -e '.[test]')"
nbformat = pytest.importorskip("nbformat", reason=WHY)
nbclient = pytest.importorskip("nbclient", reason=WHY)
kernelspec = pytest.importorskip("jupyter_client.kernelspec", reason=WHY)
kernel_manager = pytest.importorskip("jupyter_client.manager", reason=WHY)

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "equivalence.ipynb"
KERNEL = "moe-front-jax-tests"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_notebook_runs(tmp_path):
    # A kernelspec of this very interpreter: whatever "python3" resolves to on this machine may be
    # another environment without the package.
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "moe-front-jax tests",
        "language": "python",
    }))
    specs = kernelspec.KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    manager = kernel_manager.KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, km=manager, kernel_name=KERNEL, timeout=240,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # a failing chex assertion raises CellExecutionError
    text = "".join(
        output.get("text", "") for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
    )
    ran = {name.strip() for name in text.split("backends that ran:")[1].splitlines()[0].split(",")}
    assert {"interpret", "xla"} <= ran, ran
    # Every stage's kernel covers the notebook's requests, so the notebook must have run them all.
    assert "not run (not covered by a kernel): none" in text
    tables = [
        output["data"]["text/markdown"] for cell in nb.cells if cell.cell_type == "code"
        for output in cell.outputs if "text/markdown" in output.get("data", {})
    ]
    assert tables
    for row in ("| xla | 1 | 37 | moe_front | ok | exact |", "| xla | 1 | 37 | nn.MoEFront | ok | exact |",
                "| xla | 8 | 37 | moe_front | ok | exact |", "| xla | 8 | 37 | nn.MoEFront | ok | exact |"):
        assert row in tables[0], row
    interpret_rows = [f"| interpret | 1 | 37 | {stage} | ok |" for stage in
                      ("front_gemm", "route", "shared_expert", "plan", "moe_front")]
    for row in interpret_rows + ["| interpret | 8 | 37 | moe_front | ok |"]:
        assert row in tables[0], row
