"""The TMA schedule's split-K gate/up against XLA's, element by element, repeated (GPU only).

  python benchmarks/tma_split_check.py [--tp 8] [--batches 1,7,16,37,64] [--repeats 3]

For each batch: ``hidden`` from the TMA gate/up with K split 8 and 14 ways against XLA's
(``reference.situ`` of XLA's product), as the largest distance in bfloat16 ulps and the count of
elements more than 2 ulps apart; and whether repeated calls on the same inputs give the same bits
(a race between a TMA store and the next write of its shared memory shows as run-to-run changes).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax.pallas import shared_expert as se
from moe_front_jax.pallas.streaming import GemmConfig
from shared_expert_timing import Shape, gate_up_copies, rows
from tune_shared_expert import XLA


def ulps(a, b) -> np.ndarray:
    """Distance in bfloat16 ulps (ordered bit patterns) between bfloat16 arrays."""
    def ordered(v):
        bits = np.asarray(v).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--batches", default="1,7,16,37,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    s = Shape.k3(args.tp)
    w = gate_up_copies(s)[0]
    for batch in map(int, args.batches.split(",")):
        x = rows(batch, s.hidden)
        want = XLA["gate_up"](args.tp)(x, w)
        for split, block_k in ((8, 128), (14, 64)):
            c = GemmConfig(64, block_k, split, 4, 4, tma=True)
            fn = jax.jit(lambda x, w, c=c: se.gate_up_situ(x, w, 4.0, 25.0, config=c))
            outs = [np.asarray(fn(x, w)) for _ in range(args.repeats)]
            same = all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs)
            d = ulps(outs[0], np.asarray(want))
            print(f"tp{args.tp} B={batch} split {split}: max {int(d.max())} ulp, "
                  f"{int((d > 2).sum())} of {d.size} over 2 ulp, repeats identical: {same}",
                  flush=True)


if __name__ == "__main__":
    main()
