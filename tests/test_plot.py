"""benchmarks/plot.py on small synthetic results (CPU, matplotlib Agg): it writes a PNG and a table."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plot.py"


def plot_module():
    spec = importlib.util.spec_from_file_location("bench_plot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results(stage="front_gemm", tps=(1, 8), batches=(1, 8, 64), floor=4650.0):
    rows = []
    for tp in tps:
        for batch in batches:
            nbytes = 4_650_000 // tp + 1000 * batch
            for backend, slow in (("pallas", 1.5), ("xla", 2.0)):
                rows.append(dict(stage=stage, backend=backend, tp=tp, batch=batch,
                                 time_us=slow * nbytes / 4.65e6 + 2, bytes=nbytes))
    return {"device": "synthetic", "rows": rows,
            "floors": {stage: {"bandwidth_gbs": floor, "label": "HBM"}}}


def write(path, data):
    path.write_text(json.dumps(data))
    return path


def test_script_writes_a_png_and_a_table(tmp_path):
    first = write(tmp_path / "gemm.json", results())
    second = write(tmp_path / "route.json", results("route", tps=(1,), batches=(1, 256)))
    out = tmp_path / "front.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(first), str(second), "-o", str(out),
                           "--table"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > height > 200  # two panels side by side
    lines = proc.stdout.splitlines()
    # front_gemm, tp=1, batch=1: bytes 4_651_000; pallas 1.5 * 1.0002 + 2 us; floor 4_651_000 / 4.65e6.
    row = next(line for line in lines if line.startswith("| front_gemm | 1 | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    pallas, xla, floor = 1.5 * 4_651_000 / 4.65e6 + 2, 2.0 * 4_651_000 / 4.65e6 + 2, 4_651_000 / 4.65e6
    assert cells[3:] == [f"{pallas:.1f}", f"{xla:.1f}", f"{xla / pallas:.2f}", f"{floor:.1f}",
                         f"{floor / pallas:.0%}"]
    assert sum(line.startswith("| route |") for line in lines) == 2


def test_floor_is_bytes_over_bandwidth():
    assert plot_module().floor_us(4_650_000_000, {"bandwidth_gbs": 4650.0}) == pytest.approx(1e3)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["rows"][0].update(backend="triton"), "'backend' must be one of"),
        (lambda d: d["rows"][0].update(time_us=-1.0), "'time_us' must be a positive float"),
        (lambda d: d["rows"][0].update(batch=1.5), "'batch' must be a positive int"),
        (lambda d: d["rows"][0].pop("bytes"), "'bytes' must be a positive int"),
        (lambda d: d.update(floors={}), "has rows but no entry under 'floors'"),
        (lambda d: d["floors"]["front_gemm"].update(bandwidth_gbs=0), "positive 'bandwidth_gbs'"),
        (lambda d: d["rows"].append(dict(d["rows"][0])), "is timed twice"),
    ],
)
def test_malformed_results_are_refused(tmp_path, mutate, message):
    data = results()
    mutate(data)
    with pytest.raises(ValueError, match=message):
        plot_module().load([write(tmp_path / "r.json", data)])


def test_files_that_disagree_on_a_floor_are_refused(tmp_path):
    a = write(tmp_path / "a.json", results(tps=(1,)))
    b = write(tmp_path / "b.json", results(tps=(2,), floor=3000.0))
    with pytest.raises(ValueError, match="disagrees"):
        plot_module().load([a, b])
    proc = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "-o",
                           str(tmp_path / "x.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "disagrees" in proc.stderr
    assert not (tmp_path / "x.png").exists()
