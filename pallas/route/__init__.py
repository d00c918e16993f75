"""Routing (SPEC section 4): the exact top-k of sigmoid + bias and the renormalized weights, one
Pallas Triton kernel (``kernel``), with its schedule table."""

from moe_front_jax.pallas.route.kernel import (
    MAX_LANES,
    RouteConfig,
    covers,
    heuristic_config,
    pick_config,
    route,
    route_bytes,
)

__all__ = ["MAX_LANES", "RouteConfig", "covers", "heuristic_config", "pick_config", "route",
           "route_bytes"]
