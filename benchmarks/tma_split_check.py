"""The TMA schedule's split-K gate/up against XLA's, element by element, repeated (GPU only).

  python benchmarks/tma_split_check.py [--tp 8] [--batches 1,7,16,37,64] [--repeats 3]

For each batch: ``hidden`` from the TMA gate/up with K whole and split 8 and 14 ways against XLA's
(``reference.situ`` of XLA's product), as the largest distance in bfloat16 ulps and the share of
elements 0, 1, 2 and more ulps apart; whether repeated calls on the same inputs give the same bits
(a race between a TMA store and the next write of its shared memory shows as run-to-run changes);
the float32 gate/up products of XLA and of the TMA kernel (its partials, summed in float64) against
float64; and the TMA down on XLA's ``hidden`` (bfloat16 from its epilogue, float32 through the partials)
against XLA's product, as the largest error relative to the row's largest value.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax.pallas import shared_expert as se
from moe_front_jax.pallas import shared_expert_tma as st
from moe_front_jax.pallas.streaming import GemmConfig
from front_gemm_timing import xla_dot
from shared_expert_timing import Shape, down_copies, gate_up_copies, rows
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
    down = down_copies(s)[0]
    for batch in map(int, args.batches.split(",")):
        x = rows(batch, s.hidden)
        want = XLA["gate_up"](args.tp)(x, w)
        for split, block_k in ((1, 128), (8, 128), (14, 64)):
            c = GemmConfig(64, block_k, split, 4, 4, tma=True)
            fn = jax.jit(lambda x, w, c=c: se.gate_up_situ(x, w, 4.0, 25.0, config=c))
            outs = [np.asarray(fn(x, w)) for _ in range(args.repeats)]
            same = all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs)
            d = ulps(outs[0], np.asarray(want))
            share = [f"{(d == u).mean():.3f}" for u in (0, 1, 2)] + [f"{(d > 2).mean():.4f}"]
            print(f"tp{args.tp} B={batch} gate/up split {split}: max {int(d.max())} ulp, share at "
                  f"0/1/2/more ulp {'/'.join(share)}, repeats identical: {same}", flush=True)
        # The float32 products themselves against float64: XLA's dot and the TMA kernel's partials.
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        scale = np.abs(exact).max(axis=1, keepdims=True)
        xla_err = np.abs(np.asarray(xla_dot(x, w), np.float64) - exact) / scale
        cells = [f"XLA {np.median(xla_err):.1e}/{xla_err.max():.1e}"]
        for split, block_k in ((1, 128), (14, 64)):
            c = GemmConfig(64, block_k, split, 4, 4, tma=True)
            xs = st._tma_rows(x)
            parts = jax.jit(lambda x, w, c=c: st._partials(x, w, 2, c, False, "probe"))(xs, w)
            y = np.asarray(parts, np.float64).sum(0)  # [2, S_r, bp]
            y = np.concatenate([y[0], y[1]], axis=0)[:, :batch].T
            e = np.abs(y - exact) / scale
            cells.append(f"split {split} {np.median(e):.1e}/{e.max():.1e}")
        print(f"tp{args.tp} B={batch} gate/up float32 error, median/max of the row's largest: "
              + ", ".join(cells), flush=True)
        h = want  # XLA's hidden
        for out_dtype in (jnp.bfloat16, jnp.float32):
            ref = np.asarray(XLA["down"](1)(h, down).astype(jnp.float32) if out_dtype == jnp.bfloat16
                             else xla_dot(h, down), np.float64)
            c = GemmConfig(64, 128, 1, 4, 3, tma=True)
            got = np.asarray(jax.jit(lambda h, d: se.down_proj(h, d, out_dtype, config=c))(h, down),
                             np.float64)
            err = (np.abs(got - ref) / np.abs(ref).max(axis=1, keepdims=True)).max()
            print(f"tp{args.tp} B={batch} down {jnp.dtype(out_dtype).name}: {err:.2e} of the row's "
                  "largest", flush=True)


if __name__ == "__main__":
    main()
