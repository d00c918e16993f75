"""Where a front-GEMM call's time goes on the GPU: the CUPTI time of each kernel it launches.

  python benchmarks/front_gemm_breakdown.py --out $OUT [--tps 1,8] [--batches 1,16,64]

For each (tp, B): the tuning table's schedule (its kernel, and the zeroing of the split-K or stream-K
counters that XLA launches before it), a grid schedule with one program per tile and no split (no
counters, no partials: the weight-stream alone, on too few SMs at tp8), and XLA's ``dot_general``.
Medians over calls with the weights rotated past the L2. The table prints last; every call's times
go to $OUT/front_gemm_breakdown.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax

from moe_front_jax.pallas import front_gemm as fg
from front_gemm_timing import Shape, cupti_us_per_kernel, decode_rows, packed_weights, xla_dot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tps", default="1,8")
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    rows = []
    for tp in map(int, args.tps.split(",")):
        shape = Shape.k3(tp)
        weights = packed_weights(shape)
        for batch in map(int, args.batches.split(",")):
            x = decode_rows(batch, shape.hidden)
            table = fg.pick_config(shape.valid, shape.shard, shape.hidden, batch)
            unsplit = fg.FrontGemmConfig(64, 128, 1, 4, 4)
            variants = {
                "table": lambda x, w, c=table: fg.front_gemm(x, w, shape.split, shape.valid, config=c),
                "one per tile": lambda x, w, c=unsplit: fg.front_gemm(x, w, shape.split, shape.valid,
                                                                      config=c),
                "xla dot": xla_dot,
            }
            for name, fn in variants.items():
                times = cupti_us_per_kernel(jax.jit(fn), x, weights)
                row = dict(tp=tp, batch=batch, variant=name,
                           config=str(table if name == "table" else unsplit if name != "xla dot"
                                      else ""),
                           kernels={k: statistics.median(v) for k, v in times.items()}, calls=times)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "calls"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "front_gemm_breakdown.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, breakdown=rows), f, indent=1)
    print(f"\n{'tp':>3} {'B':>4} {'variant':<13} {'total us':>9}  kernels (median us)")
    for r in rows:
        total = sum(r["kernels"].values())
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["kernels"].items())
        print(f"{r['tp']:>3} {r['batch']:>4} {r['variant']:<13} {total:>9.2f}  {parts}")


if __name__ == "__main__":
    main()
