"""Benchmark the Pallas routing kernel beside the XLA reference route on the GPU (CUPTI kernel time).

  python benchmarks/bench_route.py --out $OUT [--sweep]

For B in {1, 8, 16, 32, 64, 128, 256} and the K3 config (896 experts, top-16): the kernel with its
shipped schedule (``route.pick_config``) and the XLA reference route (sigmoid, bias, ``lax.top_k``,
gather, renormalize; every kernel it launches summed), timed in the same process over rotated copies
of the logits, and the ratio XLA / kernel. With ``--sweep`` also every schedule of ``SWEEP`` (to
regenerate ``pallas/tuning/<device kind>/route.json``; both selections, argmax and groups, side
by side), written to $OUT/bench_route_sweep.json with each schedule's fraction of rows whose ids
equal the reference's.
The results go to $OUT/bench_route.json in benchmarks/README.md's format (stage "route"); the table
prints last.
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
from moe_front_jax import reference
from moe_front_jax.pallas import route as rt
from timing import READ_CEILING_TBS, cupti_us_per_call

COPIES = 16
"""Logits copies rotated through (each call reads logits no earlier call just wrote or read)."""
SWEEP = [rt.RouteConfig(rows, warps) for rows, warps in
         ((1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 4), (4, 8))] + [
    rt.RouteConfig(rows, warps, "groups", group, width) for rows, warps, group, width in (
        (1, 2, 0, 0), (1, 4, 0, 0), (1, 8, 0, 0), (2, 4, 0, 0), (2, 8, 0, 0), (4, 8, 0, 0),
        (1, 4, 8, 8), (1, 8, 8, 8), (1, 4, 16, 8), (1, 8, 32, 0),
    )
]
"""Schedules ``--sweep`` times: argmax over rows and warps, then the groups selection with
``group_plan``'s sizes over rows and warps and a few other plans (8-lane groups ranked once,
``(8,)``; ``(16, 8)``; ``(32, 8, 4)``), each labelled by ``RouteConfig.name``."""
TARGET_US = {1: 3.0, 8: 3.0, 16: 3.0, 32: 3.0, 64: 3.0, 256: 5.0}
"""The issue's targets per B (none set at B=128)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="1,8,16,32,64,128,256")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    cfg = mf.KIMI_K3
    batches = list(map(int, args.batches.split(",")))
    bias = jax.random.uniform(jax.random.key(3), (cfg.experts,), jnp.float32, -0.05, 0.05)
    logits = {
        batch: [
            jax.random.normal(k, (batch, cfg.experts), jnp.float32) * 2
            for k in jax.random.split(jax.random.key(batch), COPIES)
        ]
        for batch in batches
    }
    variants = {
        "pallas": lambda batch: (lambda b, l: rt.route(l, b, cfg)),
        "xla": lambda batch: (lambda b, l: reference.route(l, b, cfg)),
    }
    if args.sweep:
        for c in SWEEP:
            variants[c.name] = (
                lambda c: lambda batch: (lambda b, l: rt.route(l, b, cfg, config=c))
            )(c)
    keys = [(batch, name) for batch in batches for name in variants]

    def compile_one(key):
        batch, name = key
        return jax.jit(variants[name](batch)).lower(bias, logits[batch][0]).compile()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = dict(zip(keys, pool.map(compile_one, keys)))
    times, kernels = {}, {}
    for batch in batches:
        # The XLA reference and the kernel back to back: a drift of the shared machine hits both.
        for name in variants:
            times[batch, name], kernels[batch, name] = cupti_us_per_call(
                compiled[batch, name], bias, logits[batch], rounds=8
            )
        print(json.dumps({"batch": batch, **{n: round(times[batch, n], 3) for n in variants},
                          "xla_kernels": kernels[batch, "xla"]}), flush=True)

    # Check while timing: the timed kernel's ids equal the reference's on these rows (random normals;
    # the GPU test covers near ties).
    agree = {}
    for batch in batches:
        want = compiled[batch, "xla"](bias, logits[batch][0])[0]
        for name in variants:
            if name != "xla":
                got = compiled[batch, name](bias, logits[batch][0])[0]
                agree[batch, name] = float(jnp.mean(jnp.all(got == want, axis=1)))

    rows = []
    for batch in batches:
        for backend in ("pallas", "xla"):
            rows.append(dict(stage="route", backend=backend, tp=1, batch=batch,
                             time_us=round(times[batch, backend], 3),
                             bytes=rt.route_bytes(batch, cfg.experts, cfg.top_k)))
    result = dict(
        device=device.device_kind,
        rows=rows,
        floors={"route": {"bandwidth_gbs": READ_CEILING_TBS * 1e3,
                          "label": f"HBM read {READ_CEILING_TBS} TB/s"}},
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_route.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.sweep:
        sweep = {str(batch): {n: times[batch, n] for n in variants} for batch in batches}
        # Fraction of rows whose ids equal the XLA reference's, per schedule (as "ids==xla" below).
        sweep["ids_agree"] = {str(batch): {n: agree[batch, n] for n in variants if n != "xla"}
                              for batch in batches}
        with open(os.path.join(args.out, "bench_route_sweep.json"), "w") as f:
            json.dump(sweep, f, indent=1)
        names = [n for n in variants if n not in ("pallas", "xla")]
        width = max(7, *map(len, names))

        def line(label, cells):
            print(f"{label:<12}" + " ".join(f"{c:>{width}}" for c in cells))

        print()
        line("sweep (us)", names)
        for batch in batches:
            line(f"  B={batch}", [f"{times[batch, n]:.2f}" for n in names])
        line("  ids==xla", [f"{min(agree[b, n] for b in batches):.3f}" for n in names])

    configs = {b: rt.pick_config(b, cfg.experts, cfg.top_k) for b in batches}
    print(f"\nroute, K3 (896 experts, top-16), {device.device_kind}, {time.strftime('%Y-%m-%d')}, "
          "CUPTI kernel time per call")
    print(f"{'B':>4} {'pallas us':>10} {'xla us':>8} {'xla/pallas':>10} {'target us':>9} "
          f"{'met':>4} {'ids==xla':>8}  config")
    for batch in batches:
        k, x = times[batch, "pallas"], times[batch, "xla"]
        target = TARGET_US.get(batch)
        met = "-" if target is None else ("yes" if k <= target and x / k >= 4 else "NO")
        if target is None:
            met = "yes" if x / k >= 4 else "NO"
        print(f"{batch:>4} {k:>10.2f} {x:>8.2f} {x / k:>10.2f} {target or '-':>9} {met:>4} "
              f"{agree[batch, 'pallas']:>8.3f}  {configs[batch].name} ({configs[batch].select})")


if __name__ == "__main__":
    main()
