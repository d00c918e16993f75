"""Routing (SPEC section 4): the exact top-k of sigmoid + bias and the renormalized weights.

``kernel`` holds the Pallas Triton kernel and its schedule lookup (``pallas/tuning/<device
kind>/route.json``, else a heuristic).
"""

from moe_front_jax.pallas.route.kernel import (
    MAX_LANES,
    RouteConfig,
    covers,
    heuristic_config,
    load_table,
    pick_config,
    route,
    route_bytes,
    table_key,
)

__all__ = ["MAX_LANES", "RouteConfig", "covers", "heuristic_config", "load_table", "pick_config",
           "route", "route_bytes", "table_key"]
