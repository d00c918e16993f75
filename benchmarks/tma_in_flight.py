"""How many K steps of wgmmas the TMA schedule lets run behind the loads (GPU only).

  python benchmarks/tma_in_flight.py --out $OUT [--batches 8,64] [--in-flight 1,2]

``shared_expert_tma.WGMMA_STEPS_IN_FLIGHT`` = N: each step waits until at most N steps' wgmmas are
pending and holds N ring slots for them, so a ring of ``num_stages`` keeps ``num_stages - N`` TMA
stages ahead. At B=64 a step's wgmmas (M=64, N=64, K=128, two parts) take an estimated 0.5 us of a
step's 0.7 us of weight transfer, where at B=8 they are an eighth of that: N=2 would let them
overlap more at the cost of one stage of loads in flight. For each N, batch and kernel, the
tuning table's schedule and its neighbours are checked against XLA's counterpart and timed (CUPTI,
weights rotated past the L2), XLA's counterpart beside them. The table prints last; the rows go to
$OUT/tma_in_flight.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax.pallas import shared_expert as se
from moe_front_jax.pallas import shared_expert_tma as st
from moe_front_jax.pallas.streaming import GemmConfig
from front_gemm_timing import cupti_us_per_call, tbs
from shared_expert_timing import Shape, down_copies, gate_up_copies, rows
from tune_shared_expert import XLA

SCHEDULES = {  # (block_k, num_stages) per kernel: the table's choices and their neighbours
    "gate_up": ((128, 4), (128, 5), (64, 6), (64, 8)),
    "down": ((128, 6), (128, 8), (256, 4), (64, 8)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--in-flight", default="1,2")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    s = Shape.k3(1)
    weights = dict(gate_up=gate_up_copies(s), down=down_copies(s))
    batches = list(map(int, args.batches.split(",")))
    data = {(b, "gate_up"): rows(b, s.hidden) for b in batches}
    data |= {(b, "down"): rows(b, s.shared, seed=3) for b in batches}
    results = []
    for batch in batches:
        for kernel in ("gate_up", "down"):
            x, w = data[batch, kernel], weights[kernel]
            want = np.asarray(XLA[kernel](1)(x, w[0]), np.float64)
            xla_us, _ = cupti_us_per_call(jax.jit(XLA[kernel](1)).lower(x, w[0]).compile(), x, w)
            results.append(dict(batch=batch, kernel=kernel, in_flight=None, us=xla_us))
            for n in map(int, args.in_flight.split(",")):
                st.WGMMA_STEPS_IN_FLIGHT = n  # read when the kernels are traced, below
                for block_k, stages in SCHEDULES[kernel]:
                    if stages <= n:
                        continue
                    c = GemmConfig(64, block_k, 1, 4, stages, tma=True)
                    fn = ((lambda x, w, c=c: se.gate_up_situ(x, w, 4.0, 25.0, config=c))
                          if kernel == "gate_up" else (lambda h, w, c=c: se.down_proj(h, w, config=c)))
                    row = dict(batch=batch, kernel=kernel, in_flight=n, block_k=block_k,
                               stages=stages)
                    try:
                        compiled = jax.jit(fn).lower(x, w[0]).compile()
                        got = np.asarray(compiled(x, w[0]), np.float64)
                        err = float((np.abs(got - want) / (np.abs(want).max(1, keepdims=True))).max())
                        row["err"] = err
                        if err <= 2.0**-6:
                            row["us"] = cupti_us_per_call(compiled, x, w)[0]
                    except Exception as e:  # a variant that fails is recorded, not fatal
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    results.append(row)
                    print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tma_in_flight.json"), "w") as f:
        json.dump(dict(device=device.device_kind, rows=results), f, indent=1)
    nbytes = dict(gate_up=s.gate_up_bytes, down=s.down_bytes)
    print(f"\n{'B':>3} {'kernel':>8} {'xla':>7} | in flight: schedule us (TB/s) ...")
    for batch in batches:
        for kernel in ("gate_up", "down"):
            mine = [r for r in results if r["batch"] == batch and r["kernel"] == kernel]
            xla = next(r["us"] for r in mine if r["in_flight"] is None)
            cells = [f"{r['in_flight']}: k{r['block_k']}s{r['stages']} "
                     + (f"{r['us']:.2f} ({tbs(nbytes[kernel], r['us']):.2f})" if "us" in r
                        else "failed")
                     for r in mine if r["in_flight"] is not None]
            print(f"{batch:>3} {kernel:>8} {xla:>7.2f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
