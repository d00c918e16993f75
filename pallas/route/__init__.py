"""Routing (SPEC section 4): the exact top-k of sigmoid + bias and the renormalized weights, and
(``permute``) the dispatch order of SPEC section 4.1 in the same launch; ``permutation``, that order
alone from given ids.

``kernel`` holds the Pallas Triton kernel and its schedule lookup (``pallas/tuning/<device
kind>/route.json``, else a heuristic). ``mosaic`` holds the Mosaic GPU kernels, the same contract
off the deprecated Triton backend and the grouped and softmax routing of SPEC 4.2 and 4.3 besides:
``route_mosaic`` (the order a second launch; its schedule a ``mosaic.MosaicRouteConfig``),
``permutation_mosaic`` and their ``covers_mosaic`` and ``covers_permutation_mosaic``. ``stage``
holds the routing stage's kernel: one of the two, by a rule measured on an H100.
"""

from moe_front_jax.pallas.route import mosaic
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
from moe_front_jax.pallas.route.mosaic import covers as covers_mosaic
from moe_front_jax.pallas.route.mosaic import covers_permutation as covers_permutation_mosaic
from moe_front_jax.pallas.route.mosaic import permutation as permutation_mosaic
from moe_front_jax.pallas.route.mosaic import route as route_mosaic

__all__ = ["MAX_LANES", "MAX_PERMUTE_ROWS", "RouteConfig", "covers", "covers_mosaic",
           "covers_permutation", "covers_permutation_mosaic", "heuristic_config", "load_table",
           "mosaic", "permutation", "permutation_mosaic", "permute_bytes", "pick_config", "route",
           "route_bytes", "route_mosaic", "table_key"]
