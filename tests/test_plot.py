"""benchmarks/plot.py on small synthetic results (CPU, matplotlib Agg): it writes a PNG and a table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

import scripts

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plot.py"


def plot_module():
    return scripts.load(SCRIPT, "bench_plot")


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
    assert cells[3:] == [f"{pallas:.2f}", f"{xla:.2f}", f"{xla / pallas:.2f}", f"{floor:.2f}",
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


def mailbox_results(batches=(1, 64)):
    """``bench_mailbox.py``'s format: per batch, each path's ``{"us": ...}``."""
    return {"device": "synthetic", "batches": [
        dict(batch=b, direct=dict(us=20.0 + b), mailbox=dict(us=21.5 + b),
             direct_pallas=dict(us=19.0 + b), mailbox_pallas=dict(us=20.0 + b),
             exchange=dict(us=2.0), publish_us=1.0) for b in batches]}


def test_table_alone_writes_no_figure_and_takes_the_mailbox(tmp_path):
    gemm = write(tmp_path / "gemm.json", results())
    box = write(tmp_path / "box.json", mailbox_results())
    proc = subprocess.run([sys.executable, str(SCRIPT), str(gemm), str(box), "--table"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" not in proc.stdout and not list(tmp_path.glob("*.png"))
    lines = proc.stdout.splitlines()
    row = next(line for line in lines if line.startswith("| 64 |"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "64", "83.00", "84.00", "+1.00", "84.00", "85.50", "+1.50", "2.00"]
    assert any(line.startswith("| front_gemm | 8 | 64 |") for line in lines)


def test_the_mailbox_alone_has_no_figure(tmp_path):
    box = write(tmp_path / "box.json", mailbox_results())
    proc = subprocess.run([sys.executable, str(SCRIPT), str(box), "-o", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no rows to plot" in proc.stderr
    first_files = {"batches": [dict(batch=1, direct=dict(us=20.0), mailbox=dict(us=21.0))]}
    only = plot_module().table(plot_module().load([write(tmp_path / "old.json", first_files)]))
    assert only.splitlines()[-1] == "| 1 | - | - | - | 20.00 | 21.00 | +1.00 | - |"
    with pytest.raises(ValueError, match="'mailbox' needs a positive 'us'"):
        bad = {"batches": [dict(batch=1, direct=dict(us=20.0), mailbox=dict(us=-1))]}
        plot_module().load([write(tmp_path / "bad.json", bad)])


def test_bandwidth_replaces_every_floor():
    module = plot_module()
    data = {"rows": [], "floors": {"route": {"bandwidth_gbs": 4650.0, "label": "x"},
                                   "plan": {"bandwidth_gbs": 3360.0, "label": "y"}}}
    floors = module.with_bandwidth(data, 3350.0)["floors"]
    assert floors == {s: {"bandwidth_gbs": 3350.0, "label": "3.35 TB/s"} for s in ("route", "plan")}
    with pytest.raises(ValueError, match="positive"):
        module.with_bandwidth(data, 0.0)


def test_spans_in_a_files_detail_get_columns_of_their_own(tmp_path):
    data = results("shared_expert", tps=(1,), batches=(1, 64))
    data["detail"] = [dict(tp=1, batch=1, pallas_span_us=9.5, xla_span_us=11.25),
                      dict(tp=1, batch=64, pallas_span_us=12.0, span_error="not in order")]
    module = plot_module()
    lines = module.table(module.load([write(tmp_path / "se.json", data)])).splitlines()
    assert lines[0].endswith("| pallas span (us) | xla span (us) |")
    assert lines[1].count("---") == 10
    assert lines[2].endswith("| 9.50 | 11.25 |") and lines[3].endswith("| 12.00 | - |")
    assert "span" not in module.table(module.load([write(tmp_path / "g.json", results())]))


def test_engine_rows_get_a_line_and_columns_of_their_own(tmp_path):
    data = results(tps=(1,), batches=(1, 64))
    data["rows"].append(dict(stage="front_gemm", backend="engine", tp=1, batch=64, time_us=2.5,
                             bytes=4_714_000))
    first = write(tmp_path / "gemm.json", data)
    out = tmp_path / "front.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(first), "-o", str(out), "--table"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "| engine (us) | xla / engine |" in next(line for line in lines if line.startswith("| stage"))
    timed = [c.strip() for c in next(line for line in lines if line.startswith("| front_gemm | 1 | 64 |"))
             .strip("|").split("|")]
    xla = 2.0 * 4_714_000 / 4.65e6 + 2
    assert timed[-2:] == ["2.50", f"{xla / 2.5:.2f}"]
    untimed = next(line for line in lines if line.startswith("| front_gemm | 1 | 1 |"))
    assert untimed.endswith("| - | - |")


BENCH_FRONT = SCRIPT.parent / "bench_front.py"


def test_bench_front_replot_groups_kernels_by_kind(tmp_path):
    """``bench_front.py --replot``: both figures, and a kernel kind's time a layer summed over the
    names XLA numbers per layer (two sorts of 1.5 and 2.0 us a layer are one sort of 3.5)."""
    row = dict(backend="xla", tp=8, batch=8, layers=2, kernels_per_layer=3, cupti_us=9.5,
               span_us=10.0, wall_us=50.0, dispatch_us=20.0, pipelined_us=12.0, floor_us=4.0,
               weight_bytes=1, kernel_us={"gemm_fusion_dot_3": 6.0, "sort_1_1": 1.5, "sort_7": 2.0})
    data = write(tmp_path / "bench_front.json",
                 {"device": "synthetic", "read_ceiling_tbs": 3.0, "layers": 2, "rows": [row],
                  "failed": []})
    proc = subprocess.run([sys.executable, str(BENCH_FRONT), "--replot", str(data), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    for name in ("bench_front.png", "bench_front_breakdown.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "  tp8 B=8 xla: gemm_fusion_dot 6.0, sort 3.5" in proc.stdout.splitlines()
    assert "| 8 | 8 | 4.0 | 10.0 / 9.5 / 50 (3) | nan |" in proc.stdout.splitlines()
