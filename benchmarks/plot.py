"""Plot the benchmark results: time per call against batch size, one panel per stage.

Reads the JSON files the benchmark scripts write (format below and in benchmarks/README.md), merges
them, and writes a PNG: for each stage a panel with the batch size on a log axis, our Pallas kernel
(solid) beside XLA (dotted) for every tp, and the memory floor of the same tp dashed. With
``--table`` it also prints a markdown table (time, ratio to XLA, fraction of the floor).

Result format (one JSON object per file)::

  {
    "device": "NVIDIA H200",                        # optional, shown in the title
    "rows": [                                       # one timed configuration each
      {"stage": "front_gemm", "backend": "pallas",  # backend: "pallas" or "xla"
       "tp": 1, "batch": 8,                         # ranks and decode rows of the call
       "time_us": 21.4,                             # device time per call, microseconds
       "bytes": 64225280}                           # bytes one call must move (its roofline count)
    ],
    "floors": {                                     # the bandwidth that bounds each stage
      "front_gemm": {"bandwidth_gbs": 4650, "label": "HBM read 4.65 TB/s"}
    }
  }

A stage's floor at a batch size is ``bytes / bandwidth``: ``bytes / (bandwidth_gbs * 1e3)``
microseconds. Every stage in ``rows`` needs a floor; two files may repeat a stage's floor only with
the same values.

Usage::

  python benchmarks/plot.py RESULT.json [RESULT.json ...] -o benchmarks/front.png [--table]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

BACKENDS = ("pallas", "xla")
ROW_FIELDS = {"stage": str, "backend": str, "tp": int, "batch": int, "time_us": float, "bytes": int}
STYLE = {"pallas": dict(linestyle="-", marker="o"), "xla": dict(linestyle=":", marker="s")}


def load(paths: list[Path]) -> dict:
    """Merge result files into ``{"device", "rows", "floors"}``, validating every row and floor.

    Raises:
      ValueError: naming the file and the row or stage that is malformed, a stage without a floor, two
        files that disagree about a floor, or the same (stage, backend, tp, batch) timed twice.
    """
    rows, floors, devices = [], {}, set()
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read results file {str(path)!r}: {error}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"{str(path)!r}: expected an object with a list under 'rows'")
        if "device" in data:
            devices.add(str(data["device"]))
        for i, row in enumerate(data["rows"]):
            rows.append(_check_row(row, f"{path}: rows[{i}]"))
        for stage, floor in data.get("floors", {}).items():
            bandwidth = floor.get("bandwidth_gbs") if isinstance(floor, dict) else None
            if not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
                raise ValueError(
                    f"{str(path)!r}: floors[{stage!r}] needs a positive 'bandwidth_gbs', got {floor!r}"
                )
            floor = {"bandwidth_gbs": float(bandwidth), "label": str(floor.get("label", ""))}
            if stage in floors and floors[stage] != floor:
                raise ValueError(
                    f"{str(path)!r}: floors[{stage!r}] = {floor} disagrees with {floors[stage]} "
                    "from an earlier file"
                )
            floors[stage] = floor
    if not rows:
        raise ValueError(f"no rows in {[str(p) for p in paths]}")
    seen = set()
    for row in rows:
        key = (row["stage"], row["backend"], row["tp"], row["batch"])
        if key in seen:
            raise ValueError(f"(stage, backend, tp, batch) = {key} is timed twice")
        seen.add(key)
        if row["stage"] not in floors:
            raise ValueError(f"stage {row['stage']!r} has rows but no entry under 'floors'")
    return {"device": ", ".join(sorted(devices)), "rows": rows, "floors": floors}


def _check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where} must be an object, got {row!r}")
    out = {}
    for name, kind in ROW_FIELDS.items():
        value = row.get(name)
        ok = isinstance(value, str) if kind is str else (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0 and (kind is float or float(value).is_integer())
        )
        if not ok:
            raise ValueError(f"{where}: {name!r} must be a positive {kind.__name__}, got {value!r}")
        out[name] = kind(value)
    if out["backend"] not in BACKENDS:
        raise ValueError(f"{where}: 'backend' must be one of {BACKENDS}, got {out['backend']!r}")
    return out


def _minor_label(value: float, _) -> str:
    """Label the 2x and 5x minor ticks of a log axis in plain numbers, so spans under a decade read."""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa) in (2, 5) else ""


def floor_us(nbytes: int, floor: dict) -> float:
    """Microseconds to move ``nbytes`` at the floor's bandwidth (GB/s)."""
    return nbytes / (floor["bandwidth_gbs"] * 1e3)


def plot(results: dict, out: Path) -> None:
    """Write the figure: one panel per stage, time per call (us) against batch (log x and log y)."""
    by_stage = defaultdict(list)
    for row in results["rows"]:
        by_stage[row["stage"]].append(row)
    stages = sorted(by_stage)
    cols = min(len(stages), 2)
    nrows = -(-len(stages) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.2 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, stage in zip(axes.flat, stages):
        rows = by_stage[stage]
        floor = results["floors"][stage]
        for i, tp in enumerate(sorted({r["tp"] for r in rows})):
            color = colors[i % len(colors)]
            for backend in BACKENDS:
                line = sorted((r["batch"], r["time_us"]) for r in rows
                              if r["tp"] == tp and r["backend"] == backend)
                if line:
                    ax.plot(*zip(*line), color=color, label=f"{backend} tp={tp}", **STYLE[backend])
            bounds = {r["batch"]: r["bytes"] for r in rows if r["tp"] == tp}
            batches = sorted(bounds)
            ax.plot(batches, [floor_us(bounds[b], floor) for b in batches], color=color,
                    linestyle="--", linewidth=1, label=f"floor tp={tp}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["batch"] for r in rows}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(_minor_label))
        ax.set_title(stage + (f" (floor: {floor['label']})" if floor["label"] else ""))
        ax.set_xlabel("batch (decode rows per call)")
        ax.set_ylabel("time per call (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="best")
    for ax in list(axes.flat)[len(stages):]:
        ax.set_visible(False)
    title = "MoE front: our Pallas kernels (solid) vs XLA (dotted), memory floor dashed"
    fig.suptitle(title + (f"\n{results['device']}" if results["device"] else ""))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    """Markdown table: per stage, tp and batch, each backend's time, pallas/xla and floor/pallas."""
    cells = {(r["stage"], r["tp"], r["batch"], r["backend"]): r for r in results["rows"]}
    keys = sorted({k[:3] for k in cells})
    lines = [
        "| stage | tp | batch | pallas (us) | xla (us) | xla / pallas | floor (us) | floor / pallas |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stage, tp, batch in keys:
        ours, xla = cells.get((stage, tp, batch, "pallas")), cells.get((stage, tp, batch, "xla"))
        floor = floor_us((ours or xla)["bytes"], results["floors"][stage])
        lines.append(" | ".join([
            f"| {stage}", str(tp), str(batch),
            f"{ours['time_us']:.1f}" if ours else "-",
            f"{xla['time_us']:.1f}" if xla else "-",
            f"{xla['time_us'] / ours['time_us']:.2f}" if ours and xla else "-",
            f"{floor:.1f}",
            f"{floor / ours['time_us']:.0%} |" if ours else "- |",
        ]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="JSON files the benchmarks wrote")
    parser.add_argument("-o", "--out", type=Path, default=Path(__file__).with_name("front.png"))
    parser.add_argument("--table", action="store_true", help="also print a markdown table")
    args = parser.parse_args(argv)
    try:
        results = load(args.results)
    except ValueError as error:
        print(f"plot.py: {error}", file=sys.stderr)
        return 2
    plot(results, args.out)
    print(f"wrote {args.out} ({len(results['rows'])} rows)")
    if args.table:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
