"""The front GEMM (SPEC section 3): router logits and the latent from one pass over the packed weight.

``kernel`` holds the Pallas Triton kernels on the three schedules of ``gemm.schedule`` (the grid
with split-K, stream-K and the vector schedule), ``select`` (which one runs at given shapes, and
why) and the epilogues (plain, with the MXFP8 plan, or publishing into the mailbox).
"""

from moe_front_jax.pallas.front_gemm.kernel import (
    FrontGemmConfig,
    auto_prefers_kernel,
    auto_prefers_publish,
    covers,
    covers_publish,
    front_gemm,
    front_gemm_plan,
    front_gemm_publish,
    heuristic_config,
    load_table,
    pick_config,
    select,
    selects,
    selects_publish,
    table_key,
    ticket_count,
)

__all__ = [
    "FrontGemmConfig",
    "auto_prefers_kernel",
    "auto_prefers_publish",
    "covers",
    "covers_publish",
    "front_gemm",
    "front_gemm_plan",
    "front_gemm_publish",
    "heuristic_config",
    "load_table",
    "pick_config",
    "select",
    "selects",
    "selects_publish",
    "table_key",
    "ticket_count",
]
