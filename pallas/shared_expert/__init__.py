"""The shared expert (SPEC section 6): gate/up with situ, then down.

``triton`` holds the Pallas Triton kernels and the schedule lookup, ``tma`` the Mosaic GPU kernels
(a TMA ring into wgmma) that the TMA schedules run.
"""

from moe_front_jax.pallas.shared_expert.triton import (
    SharedExpertConfig,
    auto_prefers_kernel,
    covers,
    down_proj,
    gate_up_situ,
    heuristic_config,
    load_table,
    pick_config,
    shared_expert,
    table_key,
)

__all__ = [
    "SharedExpertConfig",
    "auto_prefers_kernel",
    "covers",
    "down_proj",
    "gate_up_situ",
    "heuristic_config",
    "load_table",
    "pick_config",
    "shared_expert",
    "table_key",
]
