"""The front's kernels, one case at a time, for Nsight Compute's hardware counters (GPU only).

  ncu --profile-from-start off ... python3 benchmarks/ncu_cases.py CASE [CASE ...]
  bash benchmarks/ncu_profile.sh CASE [CASE ...]     # the same, with this project's ncu options

Each case compiles and runs once outside the profiled range (compile, autotune, warm-up), then once
inside it (``cuProfilerStart`` / ``cuProfilerStop`` of the driver API), so ncu sees exactly one call's
kernels and no weight initialisation. ncu's own cache control flushes the L2 before each profiled
kernel, as the benchmarks' rotated weights do. Cases (Kimi-K3 shapes, seeded random weights):

- ``shared_tp{1,8}_b{B}``: the shared expert's two kernels (the tuning table's schedules);
- ``xla_shared_tp{1,8}_b{B}``: XLA's reference shared expert, the same shapes;
- ``route_b{B}``: the routing kernel on float32 logits;
- ``mailbox_b{B}``: ``moe_front`` on ``"pallas"`` with a mailbox (``front_gemm_publish``, the
  collect, the routing kernel), ``mailbox_plan_b{B}`` with ``plan=True`` (``route_collect``).
"""

from __future__ import annotations

import ctypes
import re
import sys

import jax
import jax.numpy as jnp

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.pallas import route as rt
from moe_front_jax.pallas import shared_expert as se
from shared_expert_timing import Shape, rows

CASE = re.compile(r"(?P<kind>xla_shared|shared|route|mailbox_plan|mailbox)(?:_tp(?P<tp>\d+))?_b(?P<b>\d+)")


def normal(shape: tuple[int, int], fan_in: int, seed: int) -> jax.Array:
    """One random bfloat16 weight, normal / sqrt(fan_in)."""
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32) / fan_in**0.5
    return w.astype(jnp.bfloat16)


def build(case: str):
    """A no-argument callable running one call of ``case``, and a note of what it runs."""
    match = CASE.fullmatch(case)
    if match is None:
        raise SystemExit(f"unknown case {case!r}; cases look like {CASE.pattern}")
    kind, batch = match["kind"], int(match["b"])
    tp = int(match["tp"] or 1)
    x = rows(batch, mf.KIMI_K3.hidden)
    if kind in ("shared", "xla_shared"):
        s = Shape.k3(tp)
        gate_up = normal((2 * s.shared, s.hidden), s.hidden, seed=tp)
        down = normal((s.hidden, s.shared), s.shared, seed=100 + tp)
        dtype = jnp.bfloat16 if tp == 1 else jnp.float32
        if kind == "shared":
            config = se.pick_config(s.shared, s.hidden, batch)
            fn = jax.jit(lambda x, g, d: se.shared_expert(x, g, d, s.cfg, dtype, config=config))
            return (lambda: fn(x, gate_up, down)), str(config)
        fn = jax.jit(lambda x, g, d: reference.shared_expert(x, g, d, s.cfg, dtype))
        return (lambda: fn(x, gate_up, down)), "XLA"
    cfg = mf.KIMI_K3
    if kind == "route":
        logits = jax.random.normal(jax.random.key(3), (batch, cfg.experts), jnp.float32)
        bias = jax.random.normal(jax.random.key(4), (cfg.experts,), jnp.float32) * 0.01
        fn = jax.jit(lambda l, b: rt.route(l, b, cfg))
        return (lambda: fn(logits, bias)), "route kernel"
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg, shared=False), cfg)
    state = dict(box=mf.Mailbox.create(cfg, capacity=max(batch, 8)))
    step = jax.jit(mf.moe_front, static_argnames=("plan", "backend"), donate_argnames="mailbox")

    def run():
        out, state["box"] = step(x, params, plan=kind == "mailbox_plan", backend="pallas",
                                 mailbox=state["box"])
        return out

    return run, "moe_front, pallas, mailbox"


def main() -> None:
    cases = sys.argv[1:]
    if not cases:
        raise SystemExit(__doc__)
    cuda = ctypes.CDLL("libcuda.so.1")
    for case in cases:
        run, note = build(case)
        jax.block_until_ready(run())  # compile and warm up, outside the profiled range
        print(f"== {case}: {note}", flush=True)
        cuda.cuProfilerStart()
        jax.block_until_ready(run())
        cuda.cuProfilerStop()


if __name__ == "__main__":
    main()
