"""Which implementation runs each stage of the front: the XLA reference or a Pallas kernel.

Stages and their signatures (every implementation of a stage takes the same arguments):

- ``front_gemm(x, packed, split, valid) -> (logits f32 [B, valid], latent_shard bf16 [B, n - split])``
- ``front_gemm_plan(x, packed, split, valid, block) -> (logits, latent_shard, (values, scales))``: the
  front GEMM and the MXFP8 plan of its latent shard, which the kernel writes from the GEMM's epilogue
- ``route(logits, bias, cfg) -> (ids int32 [B, K], weights bf16 [B, K])``
- ``plan(latent, block) -> (values float8_e4m3fn [B, L], scales float8_e8m0fnu [B, L / block])``
- ``shared_expert(x, gate_up, down, cfg, out_dtype) -> [B, H]``

``"xla"`` is the reference; ``"pallas"`` the GPU kernels; ``"interpret"`` the same kernels in Pallas'
interpret mode (any machine); ``"auto"`` the kernels on a GPU where one exists for the stage and is faster than
XLA there, else the reference. For the GEMMs (``AUTO_BY_SHAPE``) "there" is a shape: ``"auto"`` asks,
when it traces a call, whether the device's auto table (``pallas/tuning/<device>_auto.json``, made from
benchmark runs by ``benchmarks/auto_table.py``) measured the kernel faster at the call's shapes.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import jax

from moe_front_jax import reference

BACKENDS = ("auto", "xla", "pallas", "interpret")

REFERENCE: dict[str, Callable] = {
    "front_gemm": reference.front_gemm,
    "front_gemm_plan": reference.front_gemm_plan,
    "route": reference.route,
    "plan": reference.mxfp8_plan,
    "shared_expert": reference.shared_expert,
}

# stage -> "module:function" of its Pallas kernel, which takes the stage's arguments plus a keyword
# ``interpret: bool``. A stage missing here has no kernel yet: PENDING says which issue brings it.
KERNELS: dict[str, str] = {
    "front_gemm": "moe_front_jax.pallas.front_gemm:front_gemm",
    "front_gemm_plan": "moe_front_jax.pallas.front_gemm:front_gemm_plan",
    "route": "moe_front_jax.pallas.route:route",
    "plan": "moe_front_jax.pallas.plan:plan",
    "shared_expert": "moe_front_jax.pallas.shared_expert:shared_expert",
}
PENDING: dict[str, str] = {}

# Stages whose kernel "auto" runs only at the shapes where the device's auto table measured it faster
# than the reference: stage -> "module:function" of a predicate over the stage's arguments. On the
# H200 (pallas/tuning/h200_auto.json; benchmarks/RESULTS.md, sixth, seventh and thirteenth
# sessions) the front GEMM beat XLA's reference stage by 5% or more in every run at B=1 at every tp,
# B=2 at tp 2, 4 and 8, tp2 B=32 and tp8 B=16; the shared expert at tp1 and tp8 at every B <= 64.
AUTO_BY_SHAPE: dict[str, str] = {
    "front_gemm": "moe_front_jax.pallas.front_gemm:auto_prefers_kernel",
    "shared_expert": "moe_front_jax.pallas.shared_expert:auto_prefers_kernel",
}
# Stages whose kernel "auto" never runs: the front GEMM with the plan in its epilogue, never timed
# against XLA's GEMM followed by the plan kernel as one. "pallas" still runs it. The standalone plan
# kernel measured 2.5-3.6x faster than XLA's plan (0.9-2.1 us), so "auto" uses it.
AUTO_PREFERS_XLA: frozenset[str] = frozenset({"front_gemm_plan"})


def check_backend(backend: str) -> str:
    """Validate ``backend``; returns it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu"


def stage(name: str, backend: str) -> Callable:
    """The implementation of stage ``name`` under ``backend``.

    Raises:
      ValueError: an unknown backend or stage.
      NotImplementedError: ``"pallas"`` or ``"interpret"`` asked of a stage with no kernel yet.
    """
    check_backend(backend)
    if name not in REFERENCE:
        raise ValueError(f"unknown stage {name!r}; stages are {tuple(REFERENCE)}")
    auto_xla = not on_gpu() or name not in KERNELS or name in AUTO_PREFERS_XLA
    if backend == "xla" or (backend == "auto" and auto_xla):
        return REFERENCE[name]
    if backend == "auto" and name in AUTO_BY_SHAPE:
        return _by_shape(name)
    if name not in KERNELS:
        raise NotImplementedError(
            f"backend={backend!r}: no Pallas kernel for the {name} stage yet; it arrives with "
            f"{PENDING[name]}. Use backend='xla' (or 'auto') meanwhile."
        )
    return functools.partial(_load(KERNELS[name]), interpret=backend == "interpret")


def runs_kernel(name: str, backend: str, *args) -> bool:
    """Whether stage ``name`` under ``backend`` runs its Pallas kernel (in interpret mode or not) for
    these arguments, rather than the reference: what ``stage(name, backend)(*args)`` will run."""
    if stage(name, backend) is REFERENCE[name]:
        return False
    if backend == "auto" and name in AUTO_BY_SHAPE:
        return _load(AUTO_BY_SHAPE[name])(*args)
    return True


@functools.cache
def _by_shape(name: str) -> Callable:
    """Stage ``name`` under ``"auto"`` on a GPU: its kernel where ``AUTO_BY_SHAPE[name]`` says so for
    the call's arguments (decided at trace time, from static shapes), else the reference."""
    prefers, kernel, reference_stage = _load(AUTO_BY_SHAPE[name]), _load(KERNELS[name]), REFERENCE[name]

    def run(*args, **kwargs):
        if prefers(*args, **kwargs):
            return kernel(*args, **kwargs, interpret=False)
        return reference_stage(*args, **kwargs)

    run.__name__ = run.__qualname__ = f"auto_{name}"
    return run


@functools.cache
def _load(target: str) -> Callable:
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)
