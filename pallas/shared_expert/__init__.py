"""The shared expert (SPEC section 6): gate/up with situ, then down.

``kernel`` is the stage: ``SharedExpertConfig`` (one schedule per kernel), ``select`` (which
implementations run at given shapes, and why) and ``shared_expert``. ``triton`` holds the Pallas
Triton kernels (grid and vector schedules), ``tma`` the Mosaic GPU kernels (a TMA ring into wgmma)
and their ``TmaConfig``.
"""

from moe_front_jax.pallas.shared_expert.kernel import (
    SharedExpertConfig,
    auto_prefers_kernel,
    covers,
    heuristic_config,
    load_table,
    pick_config,
    select,
    selects,
    shared_expert,
    table_key,
)
from moe_front_jax.pallas.shared_expert.tma import TmaConfig

__all__ = [
    "SharedExpertConfig",
    "TmaConfig",
    "auto_prefers_kernel",
    "covers",
    "heuristic_config",
    "load_table",
    "pick_config",
    "select",
    "selects",
    "shared_expert",
    "table_key",
]
