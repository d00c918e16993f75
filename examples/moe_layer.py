"""One whole Kimi-K3-shaped MoE layer in JAX (``mf.layers.MoELayer``): the front, the routed experts as
grouped GEMMs over the tokens sorted by expert, and the shared expert.

    python examples/moe_layer.py [--batch 4] [--intermediate 64] [--backend auto] [--no-plan] [--small]

``moe_layer(x, params, experts)``:

1. The front, ``mf.moe_front(x, params, plan=True, permute=True)``: ids and weights ``[B, K]``, the
   latent ``[B, L]`` and its MXFP8 plan, the shared expert's output ``[B, H]``, and the ``Dispatch``
   (SPEC section 4.1): ``order`` (the ``B * K`` (token, rank) slots sorted by expert), ``group_sizes``
   and ``inverse``.
2. The routed experts in the latent width: the expert input (the plan's values times their scales,
   what an MXFP8 expert GEMM reads; the bf16 latent with ``plan=False``), its rows permuted to
   ``latent[order // K]``, so each expert's rows are contiguous; a SiLU-gated MLP per expert as two
   ``jax.lax.ragged_dot`` calls with ``group_sizes`` (``[B K, L] x [E, L, 2I]``, then ``[B K, I] x
   [E, I, L]``); each slot's output back at ``inverse``, summed over the token's K experts weighted
   by ``weights``.
3. The routed sum up-projected to the model width (``routed_up_weight`` ``[H, L]``, the LatentMoE's
   way back from the latent), plus the shared expert's output, rounded once to bfloat16.

The routed experts' weights are seeded normals (``init_experts``) with a small intermediate (64 by
default; K3's experts are wider) so that the whole layer at K3's shapes fits a CPU: 1.2 GB of expert
weights for 896 experts. On a CPU ``ragged_dot`` is dense over the experts (XLA masks each group), so
a K3 call costs seconds there; on a GPU it is XLA's grouped GEMM. ``tests/test_moe_layer_example.py``
checks the layer against a float64 numpy layer that loops over tokens and their experts.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_front_jax as mf
from moe_front_jax.layers import DOWN, GATE_UP, ROUTED_UP, MoELayer, init_experts

SMALL = mf.FrontConfig(hidden=512, experts=128, top_k=16, latent=256, shared=512)
"""``--small``: K3's proportions at a size that runs in seconds on a CPU."""


def moe_layer(x: jax.Array, params: mf.FrontParams, experts: dict, *, plan: bool = True,
              backend: str = "auto") -> tuple[jax.Array, mf.FrontOutput]:
    """One MoE layer: ``[B, H]`` bfloat16 rows to ``[B, H]`` bfloat16 (the module docstring).

    Args:
      x: ``[B, H]`` bfloat16 decode rows.
      params: the front's ``FrontParams`` (``pack_params``, or ``shard_params`` for a mesh).
      experts: ``init_experts``' weights.
      plan: feed the routed experts the MXFP8 plan (dequantized) rather than the bf16 latent.
      backend: the front's backend (``mf.moe_front``).

    Returns:
      ``(output, front)``: the layer's output and the front's ``FrontOutput``.
    """
    layer = MoELayer(params, experts[GATE_UP], experts[DOWN], experts.get(ROUTED_UP))
    return layer(x, plan=plan, backend=backend)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=64)
    parser.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas", "interpret"))
    parser.add_argument("--no-plan", action="store_true", help="feed the experts the bf16 latent")
    parser.add_argument("--small", action="store_true", help=f"{SMALL} instead of Kimi-K3")
    args = parser.parse_args(argv)
    cfg = SMALL if args.small else mf.KIMI_K3
    print(f"{jax.devices()[0].device_kind}: E={cfg.experts} K={cfg.top_k} H={cfg.hidden} "
          f"L={cfg.latent} S={cfg.shared}, expert intermediate {args.intermediate}", flush=True)
    start = time.perf_counter()
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
    experts = init_experts(jax.random.key(1), cfg, args.intermediate)
    jax.block_until_ready(experts)
    print(f"weights drawn in {time.perf_counter() - start:.1f} s", flush=True)
    x = jax.random.normal(jax.random.key(2), (args.batch, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
    layer = jax.jit(functools.partial(moe_layer, plan=not args.no_plan, backend=args.backend))
    for step in range(2):  # the first call compiles
        start = time.perf_counter()
        out, front = jax.block_until_ready(layer(x, params, experts))
        print(f"call {step}: {1e3 * (time.perf_counter() - start):.1f} ms", flush=True)
    sizes = np.asarray(front.dispatch.group_sizes)
    ok = bool(np.isfinite(np.asarray(out, np.float32)).all()) and sizes.sum() == cfg.top_k * args.batch
    print(f"output {out.shape} {out.dtype}, norm {float(jnp.linalg.norm(out.astype(jnp.float32))):.3f}; "
          f"{np.count_nonzero(sizes)} experts hold {sizes.sum()} slots (largest group {sizes.max()}); "
          f"row 0 -> experts {np.asarray(front.ids)[0].tolist()}")
    print("ok" if ok else "FAILED: a non-finite output or group sizes that do not sum to B * K")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
