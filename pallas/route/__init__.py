"""Routing (SPEC section 4): the exact top-k of sigmoid + bias and the renormalized weights, and
(``permute``) the dispatch order of SPEC section 4.1 in the same launch; ``permutation``, that order
alone from given ids.

``kernel`` holds the Pallas Triton kernel and its schedule lookup (``pallas/tuning/<device
kind>/route.json``, else a heuristic).
"""

from moe_front_jax.pallas.route.kernel import (
    MAX_LANES,
    MAX_PERMUTE_ROWS,
    RouteConfig,
    covers,
    covers_permutation,
    heuristic_config,
    load_table,
    permutation,
    permute_bytes,
    pick_config,
    route,
    route_bytes,
    table_key,
)

__all__ = ["MAX_LANES", "MAX_PERMUTE_ROWS", "RouteConfig", "covers", "covers_permutation",
           "heuristic_config", "load_table", "permutation", "permute_bytes", "pick_config", "route",
           "route_bytes", "table_key"]
