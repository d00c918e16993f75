"""Where ``backend="auto"`` runs the GEMM kernels, from benchmark runs: pallas/tuning/<kind>/auto.json.

  python benchmarks/auto_table.py --front F.json [F.json ...] --shared S.json [S.json:8 ...] \\
      [--out A.json]   (default: pallas/tuning/<the runs' device kind>/auto.json)

For the front GEMM and the shared expert ``"auto"`` chooses, per shape and batch, between the
kernel and the XLA reference stage it replaces (``reference.front_gemm``: the dot and the slices of
its product; ``reference.shared_expert``). This reads runs of ``bench_front_gemm.py`` (each row's
kernel time and ``xla_stage_us``) and of ``bench_shared_expert.py`` (its ``pallas`` and ``xla``
rows) on the GPU (benchmarks/RESULTS.md says which tuning tables each ran), and marks a (stage,
shape, batch) for the kernel only
where the kernel took at most ``1 / MARGIN`` of XLA's time in every run given: where runs disagree
within the machine's noise, and at batches no run measured, ``"auto"`` keeps XLA. A file named as
``PATH:TP[,TP...]`` counts for those tp only: a run made on an earlier table still speaks for the
shapes whose schedules have not changed since. The keys are the
tuning tables' (``front_gemm.table_key``, ``shared_expert.table_key``), so a batch takes the entry of
its power of two. Prints the table of choices; writes the JSON (the runs' times and the choice).
"""

from __future__ import annotations

import argparse
import json
import time

from moe_front_jax.pallas import front_gemm as fg
from moe_front_jax.pallas import shared_expert as se
from moe_front_jax.pallas.device import kind_folder
from timing import FrontShape, SharedShape

MARGIN = 1.05
"""The kernel must be this much faster than XLA in every run (the H200's run-to-run noise on one
shape is a few percent: benchmarks/RESULTS.md)."""


def front_times(path: str) -> dict[str, tuple[float, float]]:
    """``table key -> (kernel us, XLA reference stage us)`` of one ``bench_front_gemm.py`` run."""
    out = {}
    for row in json.load(open(path))["gemm"]:
        s = FrontShape(row["tp"])
        out[fg.table_key(s.valid, s.shard, s.hidden, row["batch"])] = (row["us"], row["xla_stage_us"])
    return out


def run_file(arg: str) -> tuple[str, set[int] | None]:
    """``PATH`` or ``PATH:TP[,TP...]`` -> (the path, the tp it counts for; None: every tp)."""
    path, _, tps = arg.partition(":")
    return path, set(map(int, tps.split(","))) if tps else None


def shared_times(arg: str) -> dict[str, tuple[float, float]]:
    """``table key -> (kernels us, XLA reference stage us)`` of one ``bench_shared_expert.py`` run
    (``arg``: ``run_file``'s form)."""
    path, tps = run_file(arg)
    us = {}
    for row in json.load(open(path))["rows"]:
        if tps is not None and row["tp"] not in tps:
            continue
        s = SharedShape(row["tp"])
        key = se.table_key(s.shared, s.hidden, row["batch"])
        us.setdefault(key, {})[row["backend"]] = row["time_us"]
    return {key: (t["pallas"], t["xla"]) for key, t in us.items() if {"pallas", "xla"} <= set(t)}


def choices(runs: list[dict[str, tuple[float, float]]]) -> dict[str, dict]:
    """Per key: every run's times and whether the kernel won by ``MARGIN`` in each of them."""
    keys = sorted(set().union(*runs), key=lambda k: [int(p.split("=")[1]) for p in k.split(",")])
    out = {}
    for key in keys:
        times = [run[key] for run in runs if key in run]
        out[key] = dict(
            kernel_us=[round(k, 3) for k, _ in times],
            xla_us=[round(x, 3) for _, x in times],
            kernel=all(x >= MARGIN * k for k, x in times),
        )
    return out


def build(front: list[str], shared: list[str]) -> dict[str, dict[str, dict]]:
    """The table's ``entries``: stage -> key -> choice."""
    return dict(front_gemm=choices([front_times(p) for p in front]),
                shared_expert=choices([shared_times(p) for p in shared]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--front", nargs="+", required=True, help="bench_front_gemm.py results")
    parser.add_argument("--shared", nargs="+", required=True, help="bench_shared_expert.py results")
    parser.add_argument("--out", default=None,
                        help="default: pallas/tuning/<the runs' device kind>/auto.json")
    args = parser.parse_args()
    devices = {json.load(open(run_file(p)[0]))["device"] for p in args.front + args.shared}
    if len(devices) != 1:
        raise SystemExit(f"the runs come from more than one device kind: {sorted(devices)}")
    kind = devices.pop()
    args.out = args.out or f"pallas/tuning/{kind_folder(kind)}/auto.json"
    entries = build(args.front, args.shared)
    table = dict(
        device_kind=kind, generated=time.strftime("%Y-%m-%d"), margin=MARGIN,
        command=f"python benchmarks/auto_table.py --front {' '.join(args.front)} "
                f"--shared {' '.join(args.shared)} --out {args.out}",
        front=args.front, shared=args.shared, entries=entries,
    )
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"{'stage':<14} {'key':<48} {'kernel us':<18} {'xla us':<18} auto runs")
    for stage, rows in entries.items():
        for key, row in rows.items():
            print(f"{stage:<14} {key:<48} {str(row['kernel_us']):<18} {str(row['xla_us']):<18} "
                  f"{'the kernel' if row['kernel'] else 'XLA'}")


if __name__ == "__main__":
    main()
