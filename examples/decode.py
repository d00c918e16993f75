"""The main job: one decode step of the Kimi-K3 MoE front on seeded random weights.

    python examples/decode.py [--batch 1 8 64] [--backend auto] [--repeats 20]

For each batch size it runs ``moe_front`` under ``jax.jit`` (with the MXFP8 plan and the shared
expert), prints each row's top experts and weights, the latent's norm and the time per call after
warm-up, and checks the SPEC's invariants. Exits with status 1 if any invariant fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_front_jax as mf
from moe_front_jax import backends


def invariant_failures(out: mf.FrontOutput, bias, cfg: mf.FrontConfig, batch: int) -> list[str]:
    """The SPEC invariants this output breaks (an empty list when it keeps them all)."""
    failures = []
    ids = np.asarray(out.ids)
    weights = np.asarray(out.weights, np.float32)
    if ids.shape != (batch, cfg.top_k) or ids.dtype != np.int32:
        failures.append(f"ids are {ids.shape} {ids.dtype}, expected ({batch}, {cfg.top_k}) int32")
    if ((ids < 0) | (ids >= cfg.experts)).any():
        failures.append(f"an id outside [0, {cfg.experts})")
    if any(len(set(row)) != cfg.top_k for row in ids.tolist()):
        failures.append("a row with a repeated expert id")
    if not np.isfinite(weights).all() or (weights < 0).any():
        failures.append("a weight that is negative or not finite")
    if cfg.renormalize and np.abs(weights.sum(-1) / cfg.routed_scaling_factor - 1).max() > 0.02:
        failures.append(f"weights that do not sum to 1: {weights.sum(-1).min():.4f}..")
    # Selection: chosen keys in rank order, none below an unchosen key (a few ulps of slack: a
    # kernel's sigmoid may differ from XLA's in the last bits).
    keys = np.asarray(jax.nn.sigmoid(out.logits) + bias, np.float32)
    keys = np.where(np.isnan(keys), -np.inf, keys)
    chosen = np.take_along_axis(keys, ids, -1)
    slack = 1e-6 * (1 + np.abs(chosen))
    if (np.diff(chosen, axis=-1) > slack[:, 1:]).any():
        failures.append("chosen experts not in rank order")
    rest = keys.copy()
    np.put_along_axis(rest, ids, -np.inf, -1)
    if (rest.max(-1) > chosen[:, -1] + slack[:, -1]).any():
        failures.append("an unchosen expert has a larger key than a chosen one")
    if out.latent.shape != (batch, cfg.latent) or not np.isfinite(np.asarray(out.latent, np.float32)).all():
        failures.append(f"latent is {out.latent.shape} or not finite")
    if out.plan is not None:
        values, scales = out.plan
        if values.shape != (batch, cfg.latent) or scales.shape != (batch, cfg.latent // cfg.plan_block):
            failures.append(f"plan shapes {values.shape} {scales.shape}")
    if out.shared is not None and not np.isfinite(np.asarray(out.shared, np.float32)).all():
        failures.append("shared output not finite")
    if int(out.status) != 0:
        failures.append(f"status {int(out.status)}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batch sizes")
    parser.add_argument("--backend", default="auto", choices=backends.BACKENDS)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per batch size")
    parser.add_argument("--rows", type=int, default=2, help="rows of routing to print per batch")
    args = parser.parse_args(argv)

    cfg = mf.KIMI_K3
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; backend={args.backend!r} -> "
          + ", ".join(f"{s}: {backends.stage(s, args.backend).__module__.split('.')[-1]}"
                      for s in ("front_gemm", "route", "shared_expert", "plan")))
    print(f"Kimi-K3 front: hidden {cfg.hidden}, {cfg.experts} experts, top-{cfg.top_k}, "
          f"latent {cfg.latent}, shared {cfg.shared}; seeded random weights (key 0)")
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
    step = jax.jit(lambda x, p: mf.moe_front(x, p, plan=True, backend=args.backend))

    failed = False
    for batch in args.batch:
        x = jax.random.normal(jax.random.key(batch), (batch, cfg.hidden)).astype(jnp.bfloat16)
        out = jax.block_until_ready(step(x, params))  # compile and warm up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(x, params))
            times.append(time.perf_counter() - start)
        print(f"\nB={batch}: {1e6 * np.median(times):.0f} us per call (median of {args.repeats}, "
              f"host clock, dispatch included); latent norm {float(jnp.linalg.norm(out.latent.astype(jnp.float32))):.2f}")
        for r in range(min(args.rows, batch)):
            pairs = " ".join(f"{e}:{w:.3f}" for e, w in
                             zip(np.asarray(out.ids[r]).tolist(), np.asarray(out.weights[r], np.float32).tolist()))
            print(f"  row {r}: {pairs}")
        failures = invariant_failures(out, params.bias, cfg, batch)
        for f in failures:
            print(f"  INVARIANT BROKEN: {f}")
        failed |= bool(failures)
    print("\nall invariants hold" if not failed else "\nsome invariants are broken")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
