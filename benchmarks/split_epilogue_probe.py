"""How XLA runs the TMA gate/up's split-K epilogue at tp8, and in which layout it is cheapest (GPU).

  python benchmarks/split_epilogue_probe.py --out $OUT [--batches 4,8,16,64] [--split 8]

The TMA gate/up with ``split_k > 1`` hands XLA float32 partials ``[split_k, 2, S_r, Bp]`` (the
weight rows as M, so the batch is the minor axis); XLA sums them, transposes to ``[B, S_r]``,
rounds gate and up to bfloat16 and applies situ. In the twelfth session's runs that took two XLA
kernels (a reduce and a transpose-and-convert, 2.2-3.2 us at tp8) beside a 7-9 us gate/up kernel.
This times three layouts of the same arithmetic on random partials (CUPTI, two copies alternated):

  weight-major   as the package ran it before this probe: sum, slice, transpose, round, situ
  situ-first     sum, round and situ on ``[S_r, Bp]``, then slice and transpose the bfloat16 result
  batch-major    partials ``[split_k, 2, Bp, S_r]`` (a kernel with the batch as M would store these):
                 sum, slice, round, situ, no transpose

and records whether each gives the first's bits (a different order of summation may not). Since
this probe the package runs situ-first without the transpose, handing the down ``hidden.T``
(``shared_expert_tma.gate_up_situ_t``); ``bench_shared_expert.py`` times that inside the whole call.
The table prints last; rows go to $OUT/split_epilogue_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax import reference
from moe_front_jax.pallas.shared_expert_tma import padded_batch
from front_gemm_timing import cupti_us_per_kernel
from shared_expert_timing import Shape

BETA, LINEAR_BETA = 4.0, 25.0


def weight_major(p, batch):
    y = p.sum(0)
    gate, up = (reference.round_to_bfloat16(y[i, :, :batch].T) for i in range(2))
    return reference.situ(gate, up, BETA, LINEAR_BETA)


def situ_first(p, batch):
    y = p.sum(0)
    gate, up = (reference.round_to_bfloat16(y[i]) for i in range(2))
    return reference.situ(gate, up, BETA, LINEAR_BETA)[:, :batch].T


def batch_major(p, batch):
    y = p.sum(0)
    gate, up = (reference.round_to_bfloat16(y[i, :batch]) for i in range(2))
    return reference.situ(gate, up, BETA, LINEAR_BETA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="4,8,16,64")
    parser.add_argument("--split", type=int, default=8)
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    s_r = Shape.k3(8).shared
    rows = []
    for batch in map(int, args.batches.split(",")):
        bp = padded_batch(batch)
        keys = jax.random.split(jax.random.key(batch), 2)
        partials = [jax.random.normal(k, (args.split, 2, s_r, bp), jnp.float32) for k in keys]
        layouts = {
            "weight-major": (weight_major, partials),
            "situ-first": (situ_first, partials),
            "batch-major": (batch_major, [p.transpose(0, 1, 3, 2) for p in partials]),
        }
        first = None
        for name, (fn, inputs) in layouts.items():
            compiled = jax.jit(lambda _, p, fn=fn: fn(p, batch)).lower(None, inputs[0]).compile()
            out = np.asarray(compiled(None, inputs[0]).astype(jnp.float32))
            first = out if first is None else first
            per_kernel = cupti_us_per_kernel(compiled, None, inputs, rounds=10)
            row = dict(batch=batch, layout=name, same_bits=bool(np.array_equal(out, first)),
                       kernels={k: float(np.median(v)) for k, v in per_kernel.items()},
                       us=float(np.median([sum(c) for c in zip(*per_kernel.values())])))
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "split_epilogue_probe.json"), "w") as f:
        json.dump(dict(device=device.device_kind, split=args.split, rows=rows), f, indent=1)
    print(f"\nsplit-K epilogue at tp8, split {args.split}: us per call (kernels)")
    for r in rows:
        kernels = ", ".join(f"{k} {v:.2f}" for k, v in r["kernels"].items())
        print(f"B={r['batch']:>2} {r['layout']:>12}: {r['us']:5.2f}  same bits {r['same_bits']}  "
              f"({kernels})")


if __name__ == "__main__":
    main()
