"""Benchmark the Pallas front GEMM beside XLA on the GPU (CUPTI kernel time, weights rotated past L2).

  python benchmarks/bench_front_gemm.py --out $OUT

For tp in {1, 2, 4, 8} and B in {1, 2, 4, 8, 16, 32, 64, 128, 256} (every power of
two, so that ``auto_table.py`` can decide every key): the kernel (tuning-table schedule),
the kernel with the MXFP8 plan from its epilogue, XLA's ``dot_general`` over the packed weight, and
the XLA reference stage (dot, slice, cast); effective TB/s over the weight bytes the kernel reads,
the floor at the measured read ceiling, and the ratio XLA / kernel. Then the whole front at tp1
(front GEMM + routing inside one jit) against the GEMM alone. The table prints last; the full results
go to $OUT/bench_front_gemm.json, with the kernels and XLA's dot under ``rows`` in
plot.py's format. A variant that fails to compile is listed under "failed" and the run goes on.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time

import jax
import jax.numpy as jnp

import moe_front_jax as mf
from moe_front_jax import registry, reference
from moe_front_jax.pallas import front_gemm as fg
from timing import (
    READ_CEILING_TBS, FrontShape, cupti_us_per_call, packed_weights, rows, tbs, xla_dot,
)


FLOORS = {"front_gemm": {"bandwidth_gbs": READ_CEILING_TBS * 1e3,
                         "label": f"weight read at {READ_CEILING_TBS} TB/s"}}


def plot_rows(rows: list[dict], shapes: dict[int, FrontShape]) -> list[dict]:
    """The kernels and XLA's ``dot_general`` per (tp, B) in plot.py's format."""
    return [
        dict(stage="front_gemm", backend=backend, tp=r["tp"], batch=r["batch"], time_us=r[key],
             bytes=shapes[r["tp"]].weight_bytes)
        for r in rows
        for backend, key in (("pallas", "us"), ("xla", "xla_dot_us"))
        if r[key] is not None
    ]


def fmt(value, width: int = 8, sign: str = "") -> str:
    """``value`` to 2 decimals in ``width`` columns, or "-" where the variant did not run."""
    return f"{value:>{sign}{width}.2f}" if value is not None else f"{'-':>{width}}"


def ratio(a, b):
    return a / b if a is not None and b is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tps", default="1,2,4,8")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    tps, batches = list(map(int, args.tps.split(","))), list(map(int, args.batches.split(",")))
    shapes = {tp: FrontShape(tp) for tp in tps}
    weights = {tp: packed_weights(shape) for tp, shape in shapes.items()}
    xs = {batch: rows(batch, 7168, seed=1) for batch in batches}
    variants = {
        "us": lambda s: lambda x, w: fg.front_gemm(x, w, s.split, s.valid),
        "plan_us": lambda s: lambda x, w: fg.front_gemm_plan(x, w, s.split, s.valid),
        "xla_dot_us": lambda s: xla_dot,
        "xla_stage_us": lambda s: lambda x, w: reference.front_gemm(x, w, s.split, s.valid),
    }
    keys = [(tp, batch, name) for tp in tps for batch in batches for name in variants]
    failed = {}

    def compile_one(key):
        tp, batch, name = key
        fn = jax.jit(variants[name](shapes[tp]))
        try:
            return fn.lower(xs[batch], weights[tp][0]).compile()
        except Exception as e:  # listed under "failed"; the other variants still run
            failed[f"tp{tp} B{batch} {name}"] = f"{type(e).__name__}: {e}"[:2000]
            return None

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = dict(zip(keys, pool.map(compile_one, keys)))
    for key, error in failed.items():
        print("FAILED", key, error.splitlines()[0], flush=True)
    timed = []
    for tp in tps:
        shape = shapes[tp]
        for batch in batches:
            selection = fg.select(shape.valid, shape.shard, shape.hidden, batch)
            row = dict(tp=tp, batch=batch, floor_us=shape.floor_us(),
                       implementation=selection.implementation, config=str(selection.config))
            for name in variants:
                if compiled.get((tp, batch, name)) is None:
                    row[name], row[name.replace("us", "kernels")] = None, None
                    continue
                row[name], kernels = cupti_us_per_call(compiled[tp, batch, name], xs[batch], weights[tp])
                row[name.replace("us", "kernels")] = kernels
            row["tbs"] = row["us"] and tbs(shape.weight_bytes, row["us"])
            timed.append(row)
            print(json.dumps(row), flush=True)

    # The whole front at tp1: GEMM + routing (the routing kernel where one is registered).
    cfg = mf.KIMI_K3
    shape = FrontShape(1)
    weights = weights.get(1) or packed_weights(shape)
    bias = jax.random.uniform(jax.random.key(3), (cfg.experts,), jnp.float32, -0.05, 0.05)
    example = jnp.zeros((1, cfg.experts), jnp.float32)
    route_name = ("the routing kernel" if registry.choose("route", "auto", example, bias, cfg).kernel
                  else "the XLA reference")
    fronts = []
    for batch in batches:
        x = xs[batch]

        def front(x, w):
            logits, latent = fg.front_gemm(x, w, shape.split, shape.valid)
            ids, weights_ = registry.run("route", "auto", logits, bias, cfg)
            return ids, weights_, latent

        gemm_us = next(r["us"] for r in timed if r["tp"] == 1 and r["batch"] == batch) if any(
            r["tp"] == 1 and r["batch"] == batch for r in timed) else None
        us, kernels = cupti_us_per_call(jax.jit(front), x, weights)
        fronts.append(dict(batch=batch, us=us, gemm_us=gemm_us, kernels=kernels, route=route_name))
        print(json.dumps(fronts[-1]), flush=True)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_front_gemm.json"), "w") as f:
        json.dump(dict(device=device.device_kind, rows=plot_rows(timed, shapes), floors=FLOORS,
                       gemm=timed, front=fronts, failed=failed), f, indent=1)
    print(f"\n{'tp':>3} {'B':>4} {'kernel':>8} {'TB/s':>6} {'floor':>6} {'x floor':>7} "
          f"{'+plan':>7} {'xla dot':>8} {'xla/k':>6} {'xla stage':>9}   (us)")
    for r in timed:
        us, dot = r["us"], r["xla_dot_us"]
        plan = r["plan_us"] - us if r["plan_us"] is not None and us is not None else None
        print(f"{r['tp']:>3} {r['batch']:>4} {fmt(us)} {fmt(r['tbs'], 6)} {r['floor_us']:>6.2f} "
              f"{fmt(ratio(us, r['floor_us']), 7)} {fmt(plan, 7, '+')} "
              f"{fmt(dot)} {fmt(ratio(dot, us), 6)} {fmt(r['xla_stage_us'], 9)}")
    print(f"\nwhole front at tp1 (GEMM + route: {route_name})")
    for r in fronts:
        times = f"{r['us'] / r['gemm_us']:.2f}x the GEMM" if r["gemm_us"] else ""
        print(f"  B={r['batch']:>3}: {r['us']:.2f} us  {times}  kernels: {', '.join(r['kernels'])}")


if __name__ == "__main__":
    main()
