"""How fast one kernel can read each weight this front reads, beside the front GEMM at B = 1.

  python benchmarks/read_by_size.py --out $OUT [--shared-only]

GPU.md's read ceiling (4.65 TB/s) is a bfloat16 sum over 2 GiB. The front's weights are 8-264 MB,
read once per call, where a kernel's start and tail weigh more. For each weight (the front GEMM's
rows at tp 1, 2, 4, 8: router and latent rows, no padding; the shared expert's gate/up and down at
tp 1 and 8, and both as one array, the bytes its call must read) this times, with CUPTI over
copies rotated past the L2, the plainest reads XLA has: ``jnp.sum(w, axis=1, dtype=float32)`` (one
float32 per row written) and ``jnp.sum(w, dtype=float32)`` (a scalar); and, on the front's
weights, the front GEMM at B = 1 with its tuned schedule and XLA's ``dot_general``. The table
prints last; the results go to $OUT/read_by_size.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from moe_front_jax.pallas import front_gemm as fg
from front_gemm_timing import Shape, cupti_us_per_call, decode_rows, packed_weights, tbs, xla_dot
from shared_expert_timing import Shape as SharedShape
from shared_expert_timing import random_copies


def row_sum(x, w):
    del x
    return jnp.sum(w, axis=1, dtype=jnp.float32)


def full_sum(x, w):
    del x
    return jnp.sum(w, dtype=jnp.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shared-only", action="store_true",
                        help="only the shared expert's weights (not the front's)")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    x = decode_rows(1, 7168)
    rows = []
    for tp in () if args.shared_only else (1, 2, 4, 8):
        s = Shape.k3(tp)
        packed = packed_weights(s)
        # The rows a kernel must read (router and latent rows): the weight bytes of the floor.
        weights = [jnp.concatenate([w[:s.valid], w[s.split:]]) for w in packed]
        row = dict(weight=f"front tp{tp}", mb=s.weight_bytes / 1e6)
        for name, fn in (("row_sum", row_sum), ("full_sum", full_sum)):
            row[name] = cupti_us_per_call(jax.jit(fn), x, weights)[0]
        del weights
        gemm = jax.jit(lambda x, w, s=s: fg.front_gemm(x, w, s.split, s.valid))
        row["front_gemm_b1"] = cupti_us_per_call(gemm, x, packed)[0]
        row["xla_dot_b1"] = cupti_us_per_call(jax.jit(xla_dot), x, packed)[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del packed
    for tp in (1, 8):
        s = SharedShape.k3(tp)
        for name, shape, nbytes in (("gate_up", (2 * s.shared, s.hidden), s.gate_up_bytes),
                                    ("down", (s.hidden, s.shared), s.down_bytes),
                                    ("both", (3 * s.shared, s.hidden), s.weight_bytes)):
            weights = random_copies(shape, shape[1], nbytes, seed=tp)
            row = dict(weight=f"shared {name} tp{tp}", mb=nbytes / 1e6)
            for kind, fn in (("row_sum", row_sum), ("full_sum", full_sum)):
                row[kind] = cupti_us_per_call(jax.jit(fn), x, weights)[0]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del weights
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "read_by_size.json"), "w") as f:
        json.dump(dict(device=device.device_kind, rows=rows), f, indent=1)
    print(f"\n{'weight':<20} {'MB':>6} {'row sum us':>10} {'TB/s':>5} {'full sum us':>11} {'TB/s':>5}"
          f" {'front B=1 us':>12} {'TB/s':>5} {'xla dot us':>10}")
    for r in rows:
        nbytes = r["mb"] * 1e6
        line = (f"{r['weight']:<20} {r['mb']:>6.1f} {r['row_sum']:>10.2f} "
                f"{tbs(nbytes, r['row_sum']):>5.2f} {r['full_sum']:>11.2f} "
                f"{tbs(nbytes, r['full_sum']):>5.2f}")
        if "front_gemm_b1" in r:
            line += (f" {r['front_gemm_b1']:>12.2f} {tbs(nbytes, r['front_gemm_b1']):>5.2f}"
                     f" {r['xla_dot_b1']:>10.2f}")
        print(line)


if __name__ == "__main__":
    main()
