"""The routing kernel that polls the Lamport mailbox: collect, route and the plan in one launch
(SPEC sections 4, 5 and 7)."""

from moe_front_jax.pallas.route_collect.kernel import (
    ROUTE_COLLECT_SPIN_LIMIT,
    covers,
    fuses_plan,
    route_collect,
    route_collect_bytes,
)

__all__ = ["ROUTE_COLLECT_SPIN_LIMIT", "covers", "fuses_plan", "route_collect",
           "route_collect_bytes"]
