"""The main job: decode steps of a model built around the Kimi-K3 MoE front, as an NNX module.

    moe-front-demo [--batch 1 8 64] [--steps 4] [--backend auto] [--small]

(``python examples/decode.py`` and ``make demo`` run the same ``main``.) ``DecodeModel`` is a
stand-in for one Kimi-K3 decoder layer around ``mf.nn.MoEFront``: token embedding, RMSNorm, the front
(with the MXFP8 plan and the shared expert), the routed experts as one vector each (standing in for
the MXFP4 expert MLPs), and a head that picks the next token. It draws seeded random weights, then
runs every step under ``nnx.jit`` and prints a progress line per step: its time, row 0's top
experts, row 0's latent norm, the next tokens and whether the SPEC's invariants hold. Exits with
status 1 if any invariant fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import moe_front_jax as mf

VOCAB = 4096
"""Tokens of the stand-in model's embedding and head."""
SMALL = mf.FrontConfig(hidden=512, experts=128, top_k=16, latent=256, shared=512)
"""``--small``: K3's proportions at a size that initialises and compiles in seconds on a CPU."""
BACKENDS = ("auto", "xla", "pallas", "interpret")
"""``--backend`` choices: those of ``mf.moe_front``."""


def runs(backend: str) -> str:
    """What ``backend`` runs on this machine, in words."""
    gpu = jax.default_backend() in ("gpu", "cuda")
    return {
        "xla": "the plain-JAX reference (mf.reference)",
        "pallas": "the Pallas kernels",
        "interpret": "the Pallas kernels in interpret mode",
        "auto": "the Pallas kernels where they measured faster than XLA, else the reference" if gpu
        else "the plain-JAX reference (no GPU here)",
    }[backend]


def param_bytes(model: nnx.Module) -> int:
    """Bytes of every Param of ``model`` (abstract arrays suffice)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


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


def progress(elapsed: float, out: mf.FrontOutput, tokens, failures: list[str]) -> str:
    """A step's progress line after its number: time, row 0's first experts and latent norm, the first
    next tokens, and whether the invariants hold."""
    experts = " ".join(map(str, np.asarray(out.ids[0, :3]).tolist()))
    shown = " ".join(map(str, np.asarray(tokens[:3]).tolist())) + (" .." if len(tokens) > 3 else "")
    norm = float(np.linalg.norm(np.asarray(out.latent[0], np.float32)))
    return (f"{1e3 * elapsed:7.1f} ms  row 0: experts {experts} .., latent norm {norm:.1f}  "
            f"next {shown}  " + ("invariants hold" if not failures else "INVARIANTS BROKEN"))


class DecodeModel(nnx.Module):
    """A stand-in decoder layer around the MoE front: tokens in, the front's output and next tokens out.

    ``x = RMSNorm(embed(tokens))``; ``out = front(x)``; the layer's output ``x + sum_k w_k expert[id_k] +
    shared`` goes through the head, whose argmax is the next token. Only the front is the real thing:
    the routed experts are one bfloat16 vector each, and there is no attention.
    """

    def __init__(self, cfg: mf.FrontConfig, backend: str, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, cfg.hidden, param_dtype=jnp.bfloat16, rngs=rngs)
        self.norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.front = mf.nn.MoEFront(cfg, rngs=rngs, backend=backend)
        experts = jax.random.normal(rngs.params(), (cfg.experts, cfg.hidden), jnp.float32) * 0.1
        self.experts = nnx.Param(experts.astype(jnp.bfloat16))
        self.head = nnx.Linear(cfg.hidden, VOCAB, use_bias=False, param_dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[mf.FrontOutput, jax.Array]:
        x = self.norm(self.embed(tokens)).astype(jnp.bfloat16)
        out = self.front(x, plan=True)
        chosen = self.experts[...][out.ids].astype(jnp.float32)  # [B, K, H]
        routed = jnp.einsum("bk,bkh->bh", out.weights.astype(jnp.float32), chosen)
        hidden = (x.astype(jnp.float32) + routed + out.shared.astype(jnp.float32)).astype(jnp.bfloat16)
        return out, jnp.argmax(self.head(hidden), axis=-1).astype(jnp.int32)


def main(argv=None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when None), run the decode steps; 0 if every invariant held,
    else 1."""
    parser = argparse.ArgumentParser(prog="moe-front-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="decode batch sizes")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per batch size")
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--rows", type=int, default=1,
                        help="rows of routing to print after the last step")
    parser.add_argument("--small", action="store_true",
                        help=f"a scaled-down model (hidden {SMALL.hidden}, {SMALL.experts} experts), "
                        "for a quick run")
    args = parser.parse_args(argv)
    for name in ("steps", "rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.batch) < 1:
        parser.error(f"--batch sizes must be >= 1, got {args.batch}")

    cfg = SMALL if args.small else mf.KIMI_K3
    name = "scaled-down" if args.small else "Kimi-K3"
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {device}; backend={args.backend!r}: {runs(args.backend)}")
    print(f"{name} front: hidden {cfg.hidden}, {cfg.experts} experts, top-{cfg.top_k}, "
          f"latent {cfg.latent}, shared {cfg.shared}")
    size = param_bytes(nnx.eval_shape(lambda: DecodeModel(cfg, args.backend, nnx.Rngs(0))))
    print(f"drawing {name} weights (seed 0, {size / 1e6:.0f} MB with the stand-in layer) ...",
          end=" ", flush=True)
    start = time.perf_counter()
    model = DecodeModel(cfg, args.backend, nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    print(f"{time.perf_counter() - start:.1f} s", flush=True)
    bias = model.front.bias[...]
    # graph_updates=False: the step updates no Variable, so none comes back. Graph-mode nnx.jit would
    # return every Param of the model and XLA copy each one into a fresh buffer per step.
    step = nnx.jit(lambda model, tokens: model(tokens), graph_updates=False)

    failed = False
    for batch in args.batch:
        tokens = jax.random.randint(jax.random.key(batch), (batch,), 0, VOCAB, jnp.int32)
        print(f"\nB={batch}: {args.steps} decode steps (the first compiles)", flush=True)
        times = []
        for i in range(args.steps):
            start = time.perf_counter()
            out, tokens = jax.block_until_ready(step(model, tokens))
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            failures = invariant_failures(out, bias, cfg, batch)
            failed |= bool(failures)
            print(f"  step {i + 1}/{args.steps}: {progress(elapsed, out, tokens, failures)}",
                  flush=True)
            for f in failures:
                print(f"    INVARIANT BROKEN: {f}")
        if args.steps > 1:
            median = 1e3 * np.median(times[1:])
            print(f"  {median:.1f} ms per step after compiling (median of {args.steps - 1}; host clock, "
                  "the whole stand-in layer)")
        for r in range(min(args.rows, batch)):
            pairs = [f"{e}:{w:.3f}" for e, w in
                     zip(np.asarray(out.ids[r]).tolist(), np.asarray(out.weights[r], np.float32).tolist())]
            print(f"  last step, row {r}, expert:weight")
            for j in range(0, len(pairs), 8):
                print("    " + " ".join(pairs[j:j + 8]))
    print("\nall invariants hold" if not failed else "\nsome invariants are broken")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
