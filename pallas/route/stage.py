"""The routing stage's kernel: the Mosaic GPU kernel (``mosaic.route``) or the Pallas Triton one
(``kernel.route``), whichever ``selects`` names for the arguments; ``covers`` takes what either
covers.

The rule, from CUPTI kernel time per call on an H100 (``benchmarks/bench_route.py --families``,
B = 1, 8, 64, Mosaic at ``mosaic.DEFAULT_CONFIG``; docs/findings.md, Routing):

- groups that drop some or softmax scoring, which the Triton kernel does not rank: Mosaic (2.6-2.8
  us at DeepSeek-V3, 2.2-2.3 at Qwen3: 4.7-6.3x XLA's route); with ``permute`` its order is
  ``mosaic.permutation``, a second launch.
- sigmoid over all experts, no dispatch order asked, ``E <= MOSAIC_MAX_EXPERTS``: Mosaic (0.83-0.99x
  the Triton kernel's time at Kimi-K2's 384 experts and GLM-4.5's 160).
- else the Triton kernel: at Kimi-K3's 896 experts Mosaic took 1.6-2.2x its time (1.4-1.9x at its
  best schedule); with ``permute`` the Triton kernel writes the order in its own launch, which
  Mosaic's two launches were not timed against.
- where Mosaic's ``covers`` refuses (Mixtral's 8 experts, E not 32 n) the Triton kernel; where
  both refuse, ``NotImplementedError`` naming both reasons.
"""

from __future__ import annotations

import jax

from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.gemm.schedule import Selection
from moe_front_jax.pallas.route import kernel, mosaic

MOSAIC_MAX_EXPERTS = 384
"""Most experts at which Mosaic routes sigmoid over all experts: the largest count measured where it
beat the Triton kernel (Kimi-K2's 384; at Kimi-K3's 896 it lost)."""


def _refusal(covers, *args, **kwargs) -> str | None:
    """Why ``covers`` refuses these arguments (its ``NotImplementedError``), or None."""
    try:
        covers(*args, **kwargs)
    except NotImplementedError as error:
        return str(error)
    return None


def selects(logits, bias, cfg: FrontConfig, *, permute: bool = False) -> Selection:
    """Which routing kernel runs ``route(logits, bias, cfg, permute=permute)`` and why (the module
    docstring's rule): ``Selection("mosaic_route", MosaicRouteConfig, reason)`` or
    ``Selection("triton_route", RouteConfig, reason)``.

    Raises ``ValueError`` for wrong arguments, ``NotImplementedError`` where neither kernel covers
    them (more than ``kernel.MAX_LANES`` experts; groups or softmax where Mosaic refuses; a dispatch
    order past either kernel's rows).
    """
    mosaic_refuses = _refusal(mosaic.covers, logits, bias, cfg, permute=permute)
    triton_refuses = _refusal(kernel.covers, logits, bias, cfg, permute=permute)
    if mosaic_refuses is None and triton_refuses is not None:
        return _chosen(mosaic.DEFAULT_CONFIG, "groups or softmax, which the Triton kernel does not "
                       "rank (4.7-6.3x XLA's route on an H100)")
    if mosaic_refuses is None and not permute and cfg.experts <= MOSAIC_MAX_EXPERTS:
        return _chosen(mosaic.DEFAULT_CONFIG, f"sigmoid over {cfg.experts} <= {MOSAIC_MAX_EXPERTS} "
                       "experts (0.83-0.99x the Triton kernel's time on an H100)")
    if triton_refuses is not None:
        raise NotImplementedError(f"neither routing kernel covers this (Mosaic: {mosaic_refuses}; "
                                  f"Triton: {triton_refuses})")
    if mosaic_refuses is not None:
        why = f"the Mosaic kernel does not cover this: {mosaic_refuses}"
    elif permute:
        why = "the dispatch order in the routing launch (Mosaic's two launches untimed)"
    else:
        why = (f"{cfg.experts} > {MOSAIC_MAX_EXPERTS} experts (Mosaic's took 1.4-2.2x its time at "
               "896 on an H100)")
    return _chosen(kernel.pick_config(logits.shape[0], cfg.experts, cfg.top_k), why)


def _chosen(config, why: str) -> Selection:
    return Selection(config.IMPLEMENTATION, config, f"{config.name}; {why}")


def covers(logits, bias, cfg: FrontConfig, *, permute: bool = False) -> None:
    """Raise ``NotImplementedError`` where neither kernel covers these arguments, ``ValueError``
    where they are wrong (``selects``)."""
    selects(logits, bias, cfg, permute=permute)


def route(logits: jax.Array, bias: jax.Array, cfg: FrontConfig, *, interpret: bool = False,
          permute: bool = False) -> tuple[jax.Array, ...]:
    """Exact top-k routing (SPEC section 4, 4.2, 4.3; with ``permute`` the dispatch order of 4.1)
    by the kernel ``selects`` names, in Pallas' interpret mode where ``interpret``: ``ids`` and
    ``weights`` ``[B, K]``, then with ``permute`` ``order``, ``group_sizes`` and ``inverse``, as
    ``reference.route``. Bytes: that kernel's (``kernel.route_bytes``, each ``permute_bytes``).
    Raises as ``selects``."""
    selection = selects(logits, bias, cfg, permute=permute)
    run = mosaic.route if isinstance(selection.config, mosaic.MosaicRouteConfig) else kernel.route
    return run(logits, bias, cfg, interpret=interpret, permute=permute, config=selection.config)
