"""Benchmark the Pallas shared expert beside XLA's on the GPU (CUPTI time, weights rotated past L2).

  python benchmarks/bench_shared_expert.py --out $OUT [--table <a tuner table>] [--spans]

For tp in {1, 8} and B in {1, 2, 4, 8, 16, 32, 64}: the two kernels (gate/up with situ, then down; the tuning
table's schedules, or --table's) and the XLA reference stage (``reference.shared_expert``: dot, slice,
casts, situ, dot), each in the dtype ``moe_front`` asks for (bfloat16 at tp1, the float32 partial sum
under tp); effective TB/s over the weight bytes (gate_up + down), the floor at the measured read
ceiling, and the ratio XLA / kernel. With ``--spans``, each call's span too (``timing.span``: its
first kernel's start to its last kernel's end in a profiler trace of 8 calls in sequence, the gaps
between its kernels included, which CUPTI's sums leave out). The table prints last; the results go
to $OUT/bench_shared_expert.json in benchmarks/README.md's format (stage "shared_expert").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time

import jax
import jax.numpy as jnp

import timing
from moe_front_jax import reference
from moe_front_jax.pallas import shared_expert as se
from timing import READ_CEILING_TBS, SharedShape, cupti_us_per_call, random_copies, rows, tbs


def chain_operands(shape: SharedShape, batch: int) -> tuple[list, list]:
    """``timing.CHAIN`` distinct rows ``x`` and ``(gate_up, down)`` pairs for a span's
    program (distinct, so that XLA merges no dots across its calls)."""
    nbytes = timing.CHAIN * shape.weight_bytes
    pairs = list(zip(
        random_copies((2 * shape.shared, shape.hidden), shape.hidden, nbytes, seed=shape.tp),
        random_copies((shape.hidden, shape.shared), shape.shared, nbytes, seed=100 + shape.tp),
    ))[:timing.CHAIN]
    return [rows(batch, shape.hidden, seed=i) for i in range(timing.CHAIN)], pairs


def spans(row: dict, fns: dict, operands: tuple[list, list]) -> None:
    """``row[backend + "_span_us"]``, ``timing.span``'s median call span of ``fns[backend]``
    over ``operands`` (``chain_operands``), and the traced programs' kernels
    (``row[backend + "_timeline"]``), for each backend; a trace that does not split into calls is
    ``row[backend + "_span_error"]``."""
    for backend, fn in fns.items():
        timed = dict(kernels=row[backend + "_kernels"])
        timing.span(timed, timing.chain_program(fn, *operands))
        for key in ("call_span_us", "span_error", "timeline"):
            if key in timed:
                row[f"{backend}_{key.removeprefix('call_')}"] = timed[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tps", default="1,8")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--table", default=None,
                        help="take the schedules from this table file instead of the package's")
    parser.add_argument("--spans", action="store_true",
                        help="also time each call's span, its kernels' gaps included")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    tps, batches = list(map(int, args.tps.split(","))), list(map(int, args.batches.split(",")))
    shapes = {tp: SharedShape(tp) for tp in tps}
    table = {}
    if args.table and not os.path.exists(args.table):
        print(f"no table at {args.table}: the package's table or the heuristic", flush=True)
    elif args.table:
        entries = json.load(open(args.table))["entries"]
        table = {k: se.SharedExpertConfig.from_json(v) for k, v in entries.items()}
    # (gate_up, down) pairs, enough distinct pairs to exceed the rotation bytes together.
    weights = {}
    for tp, s in shapes.items():
        gate_ups = random_copies((2 * s.shared, s.hidden), s.hidden, s.weight_bytes, seed=tp)
        downs = random_copies((s.hidden, s.shared), s.shared, s.weight_bytes, seed=100 + tp)
        weights[tp] = list(zip(gate_ups, downs))
    xs = {batch: rows(batch, 7168) for batch in batches}

    def config(tp, batch):
        s = shapes[tp]
        return table.get(se.table_key(s.shared, s.hidden, batch)) or se.pick_config(
            s.shared, s.hidden, batch)

    def variant(tp, batch, backend):
        cfg, dtype = shapes[tp].cfg, jnp.bfloat16 if tp == 1 else jnp.float32
        if backend == "pallas":
            c = config(tp, batch)
            return lambda x, w: se.shared_expert(x, *w, cfg, dtype, config=c)
        return lambda x, w: reference.shared_expert(x, *w, cfg, dtype)

    keys = [(tp, batch, b) for tp in tps for batch in batches for b in ("pallas", "xla")]

    def compile_one(key):
        tp, batch, backend = key
        return jax.jit(variant(*key)).lower(xs[batch], weights[tp][0]).compile()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = dict(zip(keys, pool.map(compile_one, keys)))
    results, detail = [], []
    for tp in tps:
        s = shapes[tp]
        for batch in batches:
            row = dict(tp=tp, batch=batch, floor_us=s.floor_us(), config=str(config(tp, batch)))
            for backend in ("pallas", "xla"):
                us, kernels = cupti_us_per_call(compiled[tp, batch, backend], xs[batch], weights[tp])
                row[backend] = us
                row[backend + "_kernels"] = kernels
                results.append(dict(stage="shared_expert", backend=backend, tp=tp, batch=batch,
                                    time_us=round(us, 3), bytes=s.weight_bytes))
            detail.append(row)
            print(json.dumps(row), flush=True)
    if args.spans:  # after every CUPTI timing: the trace holds CUPTI
        del weights, compiled
        for row in detail:
            tp, batch = row["tp"], row["batch"]
            spans(row, {b: variant(tp, batch, b) for b in ("pallas", "xla")},
                  chain_operands(shapes[tp], batch))
            print(tp, batch, "span", row.get("pallas_span_us"), row.get("xla_span_us"),
                  flush=True)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_shared_expert.json"), "w") as f:
        json.dump(dict(
            device=device.device_kind, rows=results,
            floors={"shared_expert": dict(bandwidth_gbs=READ_CEILING_TBS * 1e3,
                                          label=f"HBM read {READ_CEILING_TBS} TB/s")},
            detail=detail,
        ), f, indent=1)
    print(f"\n{'tp':>3} {'B':>4} {'kernel':>8} {'TB/s':>6} {'floor':>6} {'x floor':>7} "
          f"{'xla':>8} {'TB/s':>6} {'xla/k':>6}" + ("  span: kernel / xla" if args.spans else "")
          + "   (us; weight bytes / time)")
    for r in detail:
        s = shapes[r["tp"]]
        line = (f"{r['tp']:>3} {r['batch']:>4} {r['pallas']:>8.2f} "
                f"{tbs(s.weight_bytes, r['pallas']):>6.2f} {r['floor_us']:>6.2f} "
                f"{r['pallas'] / r['floor_us']:>7.2f} {r['xla']:>8.2f} "
                f"{tbs(s.weight_bytes, r['xla']):>6.2f} {r['xla'] / r['pallas']:>6.2f}")
        if args.spans:
            line += "  " + " / ".join(f"{r.get(b + '_span_us', float('nan')):.2f}"
                                      for b in ("pallas", "xla"))
        print(line)
    for r in detail:
        print(f"  tp{r['tp']} B={r['batch']}: kernels {', '.join(r['pallas_kernels'])} | xla "
              f"{', '.join(r['xla_kernels'])} | {r['config']}")


if __name__ == "__main__":
    main()
