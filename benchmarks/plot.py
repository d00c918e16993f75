"""Plot the benchmark results: time per call against batch size, one panel per stage.

Reads the JSON files the benchmark scripts write (benchmarks/README.md, "Result format": ``rows`` of
``stage``, ``backend``, ``tp``, ``batch``, ``time_us`` and ``bytes``, and a ``floors`` entry per
stage with its ``bandwidth_gbs``), merges them, and writes a PNG: for each stage a panel with the
batch size on a log axis, our Pallas kernel (solid) and the streaming engine's (dash-dot, where
timed) beside XLA (dotted) for every tp, and the memory
floor of the same tp dashed, ``bytes / (bandwidth_gbs * 1e3)`` microseconds. With ``--table`` it
prints a markdown table (time, ratio to XLA, fraction of the floor) and writes the figure only where
``-o`` is given. ``bench_mailbox.py``'s files (a ``batches`` list, no ``rows``) get a table of their
own: the direct path and the mailbox path per backend, and what the mailbox adds.
``--bandwidth-gbs`` replaces every stage's floor (a device whose files carry another's ceiling).
Every stage in ``rows`` needs a floor; two files may repeat a stage's floor only with the same values.

Usage::

  python benchmarks/plot.py RESULT.json [RESULT.json ...] -o benchmarks/front.png [--table]
  python benchmarks/plot.py RESULT.json [...] --table [--bandwidth-gbs 3350]   # the table alone
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

BACKENDS = ("pallas", "engine", "xla")
ROW_FIELDS = {"stage": str, "backend": str, "tp": int, "batch": int, "time_us": float, "bytes": int}
STYLE = {"pallas": dict(linestyle="-", marker="o"), "engine": dict(linestyle="-.", marker="^"),
         "xla": dict(linestyle=":", marker="s")}


MAILBOX_PATHS = {"direct": "direct", "mailbox": "mailbox", "direct_pallas": "direct_pallas",
                 "mailbox_pallas": "mailbox_pallas", "exchange": "exchange"}
"""``bench_mailbox.py``'s timed paths (each ``{"us": ...}`` under a batch), by the name kept."""


def load(paths: list[Path]) -> dict:
    """Merge result files into ``{"device", "rows", "floors", "mailbox", "spans"}``, validating every
    row, floor and mailbox batch (``mailbox``: ``bench_mailbox.py``'s batches, ``{"batch", path:
    us}``; ``spans``: ``{(stage, tp, batch): {backend: us}}`` from a file's ``detail``, where
    ``bench_shared_expert.py --spans`` records each call's span, for a file of one stage).

    Raises:
      ValueError: naming the file and the row or stage that is malformed, a stage without a floor, two
        files that disagree about a floor, or the same (stage, backend, tp, batch) timed twice.
    """
    rows, floors, devices, mailbox, spans = [], {}, set(), [], {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read results file {str(path)!r}: {error}") from None
        if isinstance(data, dict) and "rows" not in data and isinstance(data.get("batches"), list):
            if "device" in data:
                devices.add(str(data["device"]))
            mailbox += [_check_mailbox(batch, f"{path}: batches[{i}]")
                        for i, batch in enumerate(data["batches"])]
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"{str(path)!r}: expected an object with a list under 'rows' "
                             "(or bench_mailbox.py's 'batches')")
        if "device" in data:
            devices.add(str(data["device"]))
        checked = [_check_row(row, f"{path}: rows[{i}]") for i, row in enumerate(data["rows"])]
        rows += checked
        stages = {row["stage"] for row in checked}
        if len(stages) == 1 and isinstance(data.get("detail"), list):
            spans.update(_spans(stages.pop(), data["detail"]))
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
    if not rows and not mailbox:
        raise ValueError(f"no rows in {[str(p) for p in paths]}")
    seen = set()
    for row in rows:
        key = (row["stage"], row["backend"], row["tp"], row["batch"])
        if key in seen:
            raise ValueError(f"(stage, backend, tp, batch) = {key} is timed twice")
        seen.add(key)
        if row["stage"] not in floors:
            raise ValueError(f"stage {row['stage']!r} has rows but no entry under 'floors'")
    batches = [m["batch"] for m in mailbox]
    if len(set(batches)) < len(batches):
        raise ValueError(f"a mailbox batch is timed twice: {sorted(batches)}")
    return {"device": ", ".join(sorted(devices)), "rows": rows, "floors": floors,
            "mailbox": sorted(mailbox, key=lambda m: m["batch"]), "spans": spans}


def _spans(stage: str, detail: list) -> dict:
    """The ``{backend}_span_us`` entries of a file's ``detail`` (positive numbers only; a program
    that was not traced as its calls in order has none), by ``(stage, tp, batch)``."""
    out = {}
    for entry in detail:
        if not isinstance(entry, dict):
            continue
        found = {b: float(entry[f"{b}_span_us"]) for b in BACKENDS
                 if isinstance(entry.get(f"{b}_span_us"), (int, float))
                 and not isinstance(entry.get(f"{b}_span_us"), bool)
                 and math.isfinite(entry[f"{b}_span_us"]) and entry[f"{b}_span_us"] > 0}
        if found and isinstance(entry.get("tp"), int) and isinstance(entry.get("batch"), int):
            out[stage, entry["tp"], entry["batch"]] = found
    return out


def _check_mailbox(batch, where: str) -> dict:
    """One batch of ``bench_mailbox.py``: its ``batch`` and the microseconds of each path it timed
    (``MAILBOX_PATHS``; the ``"pallas"`` paths and the exchange are absent from its first files)."""
    if not isinstance(batch, dict) or not isinstance(batch.get("batch"), int) or batch["batch"] < 1:
        raise ValueError(f"{where} needs a positive int 'batch', got {batch!r}")
    out = {"batch": batch["batch"]}
    for key, name in MAILBOX_PATHS.items():
        if key not in batch:
            continue
        us = batch[key].get("us") if isinstance(batch[key], dict) else None
        if isinstance(us, bool) or not isinstance(us, (int, float)) or not (math.isfinite(us)
                                                                          and us > 0):
            raise ValueError(f"{where}: {key!r} needs a positive 'us', got {batch[key]!r}")
        out[name] = float(us)
    if "direct" not in out or "mailbox" not in out:
        raise ValueError(f"{where} needs the 'direct' and 'mailbox' paths")
    return out


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


def with_bandwidth(results: dict, bandwidth_gbs: float) -> dict:
    """``results`` with every stage's floor at ``bandwidth_gbs`` (GB/s)."""
    if not bandwidth_gbs > 0:
        raise ValueError(f"--bandwidth-gbs must be positive, got {bandwidth_gbs}")
    floor = {"bandwidth_gbs": float(bandwidth_gbs), "label": f"{bandwidth_gbs / 1e3:g} TB/s"}
    return {**results, "floors": {stage: dict(floor) for stage in results["floors"]}}


def mailbox_table(batches: list[dict]) -> str:
    """Markdown table of ``bench_mailbox.py``'s batches: per backend the direct path, the mailbox
    path and what the mailbox adds (mailbox - direct, same process), and the exchange alone."""

    def us(batch, name):
        return f"{batch[name]:.2f}" if name in batch else "-"

    def added(batch, direct, mailbox):
        if direct in batch and mailbox in batch:
            return f"{batch[mailbox] - batch[direct]:+.2f}"
        return "-"

    lines = [
        '| batch | "pallas": direct (us) | mailbox (us) | added (us) '
        '| "auto": direct (us) | mailbox (us) | added (us) | exchange alone (us) |',
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in batches:
        lines.append(" | ".join([
            f"| {b['batch']}", us(b, "direct_pallas"), us(b, "mailbox_pallas"),
            added(b, "direct_pallas", "mailbox_pallas"), us(b, "direct"), us(b, "mailbox"),
            added(b, "direct", "mailbox"), us(b, "exchange") + " |",
        ]))
    return "\n".join(lines)


def table(results: dict) -> str:
    """Markdown table: per stage, tp and batch, each backend's time, pallas/xla and floor/pallas
    (the engine's time and xla/engine where any row has them; each backend's call span, where the
    files recorded spans); then the mailbox's table, if any file held ``bench_mailbox.py``'s
    batches."""
    parts = [mailbox_table(results["mailbox"])] if results.get("mailbox") else []
    if not results["rows"]:
        return parts[0]
    cells = {(r["stage"], r["tp"], r["batch"], r["backend"]): r for r in results["rows"]}
    keys = sorted({k[:3] for k in cells})
    spans = results.get("spans") or {}
    engine = any(k[3] == "engine" for k in cells)
    header = "| stage | tp | batch | pallas (us) | xla (us) | xla / pallas | floor (us) | floor / pallas |"
    if engine:
        header += " engine (us) | xla / engine |"
    if spans:
        header += " pallas span (us) | xla span (us) |"
    lines = [header, "|" + " --- |" * header.count(" |")]
    for stage, tp, batch in keys:
        ours, xla = cells.get((stage, tp, batch, "pallas")), cells.get((stage, tp, batch, "xla"))
        floor = floor_us((ours or xla)["bytes"], results["floors"][stage])
        lines.append(" | ".join([
            f"| {stage}", str(tp), str(batch),
            f"{ours['time_us']:.2f}" if ours else "-",
            f"{xla['time_us']:.2f}" if xla else "-",
            f"{xla['time_us'] / ours['time_us']:.2f}" if ours and xla else "-",
            f"{floor:.2f}",
            f"{floor / ours['time_us']:.0%} |" if ours else "- |",
        ]))
        if engine:
            eng = cells.get((stage, tp, batch, "engine"))
            lines[-1] += (f" {eng['time_us']:.2f} |" if eng else " - |") + (
                f" {xla['time_us'] / eng['time_us']:.2f} |" if eng and xla else " - |")
        if spans:
            span = spans.get((stage, tp, batch), {})
            lines[-1] += "".join(f" {span[b]:.2f} |" if b in span else " - |" for b in ("pallas", "xla"))
    return "\n\n".join(["\n".join(lines)] + parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="JSON files the benchmarks wrote")
    parser.add_argument("-o", "--out", type=Path, default=None,
                        help="the figure (default: benchmarks/front.png, unless --table is given "
                             "without -o: then no figure)")
    parser.add_argument("--table", action="store_true", help="print a markdown table")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="the floor's bandwidth (GB/s) for every stage, in place of the files'")
    args = parser.parse_args(argv)
    out = args.out or (None if args.table else Path(__file__).with_name("front.png"))
    try:
        results = load(args.results)
        if args.bandwidth_gbs is not None:
            results = with_bandwidth(results, args.bandwidth_gbs)
        if out and not results["rows"]:
            raise ValueError("no rows to plot (the mailbox's files make a table only: --table)")
    except ValueError as error:
        print(f"plot.py: {error}", file=sys.stderr)
        return 2
    if out:
        plot(results, out)
        print(f"wrote {out} ({len(results['rows'])} rows)")
    if args.table:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
