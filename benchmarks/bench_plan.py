"""Benchmark the Pallas MXFP8 plan kernel beside the XLA reference plan on the GPU (CUPTI kernel time).

  python benchmarks/bench_plan.py --out $OUT [--sweep]

For K3's latent at tp1 (L = 3584) and tp8 (L = 448) and B in {1, 8, 64, 256}: the kernel with its
shipped schedule (``plan.pick_config``) and the XLA reference plan (``reference.mxfp8_plan`` jitted;
every kernel it launches summed), timed in the same process over rotated copies of the latent, and the
ratio XLA / kernel. The copies (16, at most 29 MB) fit in the L2, as a latent just written by the GEMM
or the mailbox does. With ``--sweep`` also the schedules of ``sweep_configs`` (to choose the shipped
one), written to $OUT/bench_plan_sweep.json. The results go to $OUT/bench_plan.json in
benchmarks/README.md's format (stage "plan"); the table prints last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.pallas import plan as pp
from moe_front_jax.pallas.plan.kernel import MAX_TILE, heuristic_config
import timing
from timing import cupti_us_per_call

COPIES = 16
"""Latent copies rotated through (each call reads a latent no earlier call just read)."""
COPY_CEILING_TBS = 3.36
"""Measured HBM copy bandwidth of the H200 (2026-12-02), read and write counted: the plan's floor."""
TPS = (1, 8)


def sweep_configs(batch: int, latent: int, block: int) -> list[pp.PlanConfig]:
    """Around the heuristic: the widest segment at 1 to 16 segments a program (within ``MAX_TILE``
    elements) with the heuristic's warps; the heuristic's tile with half and twice its warps; the
    heuristic's tile made of ``block``-wide segments."""
    shipped = heuristic_config(batch, latent, block, cores=132)
    width = shipped.width
    configs = {shipped}
    rows = 1
    while rows <= 16 and rows * width <= MAX_TILE and (rows == 1 or rows <= batch * latent // width):
        configs.add(pp.PlanConfig(width, rows, max(1, min(8, rows * width // 256))))
        rows *= 2
    for warps in (shipped.num_warps // 2, shipped.num_warps * 2):
        if 1 <= warps <= 8:
            configs.add(dataclasses.replace(shipped, num_warps=warps))
    configs.add(pp.PlanConfig(block, shipped.block_rows * width // block, shipped.num_warps))
    return sorted(configs, key=lambda c: (c.width, c.block_rows, c.num_warps))


def name_of(config: pp.PlanConfig) -> str:
    return f"s{config.width}r{config.block_rows}w{config.num_warps}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    block = mf.KIMI_K3.plan_block
    batches = list(map(int, args.batches.split(",")))
    widths = {tp: mf.KIMI_K3.with_tp(tp).latent_per_rank for tp in TPS}
    shapes = [(tp, batch) for tp in TPS for batch in batches]
    # Normals over many binades (the scales differ block to block); never zeros.
    latents = {
        (tp, batch): [
            (jax.random.normal(k, (batch, widths[tp]))
             * jnp.exp2(jax.random.randint(k, (batch, widths[tp]), -20, 21))).astype(jnp.bfloat16)
            for k in jax.random.split(jax.random.key(batch * 10 + tp), COPIES)
        ]
        for tp, batch in shapes
    }
    variants = {
        shape: {"pallas": lambda _, v: pp.plan(v, block),
                "xla": lambda _, v: reference.mxfp8_plan(v, block)}
        for shape in shapes
    }
    if args.sweep:
        for tp, batch in shapes:
            for c in sweep_configs(batch, widths[tp], block):
                variants[tp, batch][name_of(c)] = (
                    lambda c: lambda _, v: pp.plan(v, block, config=c)
                )(c)
    keys = [(shape, name) for shape in shapes for name in variants[shape]]
    unused = jnp.zeros((), jnp.int32)

    def compile_one(key):
        shape, name = key
        return jax.jit(variants[shape][name]).lower(unused, latents[shape][0]).compile()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = dict(zip(keys, pool.map(compile_one, keys)))
    times, kernels = {}, {}
    for shape in shapes:
        # The XLA reference and the kernel back to back: a drift of the shared machine hits both.
        for name in variants[shape]:
            times[shape, name], kernels[shape, name] = cupti_us_per_call(
                compiled[shape, name], unused, latents[shape], rounds=8
            )
        tp, batch = shape
        print(json.dumps({"tp": tp, "batch": batch, "pallas": round(times[shape, "pallas"], 3),
                          "xla": round(times[shape, "xla"], 3), "xla_kernels": kernels[shape, "xla"]}),
              flush=True)

    # Check while timing: the timed kernel's bytes equal the reference's on every row of one copy.
    agree = {}
    for shape in shapes:
        got = compiled[shape, "pallas"](unused, latents[shape][0])
        want = compiled[shape, "xla"](unused, latents[shape][0])
        same = [jnp.all(jax.lax.bitcast_convert_type(g, jnp.uint8) == jax.lax.bitcast_convert_type(w, jnp.uint8), axis=1)
                for g, w in zip(got, want)]
        agree[shape] = float(jnp.mean(same[0] & same[1]))

    rows = []
    for tp, batch in shapes:
        for backend in ("pallas", "xla"):
            rows.append(dict(stage="plan", backend=backend, tp=tp, batch=batch,
                             time_us=round(times[(tp, batch), backend], 3),
                             bytes=pp.plan_bytes(batch, widths[tp], block)))
    timing.write_result(args.out, "bench_plan", device.device_kind, rows, "plan",
                        COPY_CEILING_TBS, f"HBM copy {COPY_CEILING_TBS} TB/s")
    if args.sweep:
        sweep = {f"tp={tp},batch={batch}": {n: times[(tp, batch), n] for n in variants[tp, batch]}
                 for tp, batch in shapes}
        with open(os.path.join(args.out, "bench_plan_sweep.json"), "w") as f:
            json.dump(sweep, f, indent=1)
        print("\nsweep (us; shipped = pallas):")
        for shape in shapes:
            best = min((n for n in variants[shape] if n != "xla"), key=lambda n: times[shape, n])
            cells = " ".join(f"{n}={times[shape, n]:.2f}" for n in variants[shape] if n not in ("pallas", "xla"))
            print(f"  tp={shape[0]} B={shape[1]:>3} best {best} {times[shape, best]:.2f}: {cells}")

    print(f"\nMXFP8 plan (blocks of {block}), K3 latent, {device.device_kind}, {time.strftime('%Y-%m-%d')}, "
          "CUPTI kernel time per call")
    print(f"{'tp':>3} {'L':>5} {'B':>4} {'pallas us':>10} {'xla us':>8} {'xla/pallas':>10} "
          f"{'GB/s':>7} {'bytes==xla':>10}  config")
    for tp, batch in shapes:
        k, x = times[(tp, batch), "pallas"], times[(tp, batch), "xla"]
        c = pp.pick_config(batch, widths[tp], block)
        gbs = pp.plan_bytes(batch, widths[tp], block) / (k * 1e3)
        print(f"{tp:>3} {widths[tp]:>5} {batch:>4} {k:>10.2f} {x:>8.2f} {x / k:>10.2f} {gbs:>7.1f} "
              f"{agree[tp, batch]:>10.3f}  {name_of(c)}")


if __name__ == "__main__":
    main()
