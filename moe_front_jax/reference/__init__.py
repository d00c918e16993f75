"""The plain-JAX reference of every stage of the MoE front, one module per SPEC section.

Plain ``jax.numpy``/``lax``, exact to SPEC.md: the oracle every kernel is tested against, what
``"xla"`` runs, and whatever ``"auto"`` and ``"interpret"`` do not hand to a kernel
(``registry.choose``). Each function works on one device's arrays;
tensor parallelism (the exchange, the shared expert's reduction) lives in ``moe_front_jax.parallel``.

| SPEC | module | functions |
| --- | --- | --- |
| 3 | ``gemm`` | ``front_gemm``, ``front_gemm_plan``, ``front_gate_up`` (with 5 and 6's first half) |
| 4 | ``routing`` | ``route``, ``permutation`` (4.1), ``ordered_key``, ``tree_sum``, ``routing_weights``, |
| | | ``select``, ``top_k_of_keys``, ``group_scores``, ``kept_groups`` (4.2), ``softmax_scores`` (4.3) |
| 5 | ``plan`` | ``mxfp8_plan``, ``plan_scale_exponent``, ``e8m0_scale_down`` |
| 6 | ``shared`` | ``shared_expert`` (``shared_hidden`` -> ``shared_down``), ``activation`` |
| | | (``situ`` or ``silu_gate``), ``round_to_bfloat16`` |
| 7 | ``mailbox`` | ``publish``, ``collect``, ``gemm_publish``, ``collect_route_plan``, the row |
| | | layout |
| 3, 6 | ``dot`` | ``rows_dot``: the product of the front GEMM and the shared expert |
"""

from moe_front_jax.reference import mailbox
from moe_front_jax.reference.gemm import front_gate_up, front_gemm, front_gemm_plan
from moe_front_jax.reference.plan import (
    E4M3_MAX,
    e8m0_scale_down,
    mxfp8_plan,
    plan_scale_exponent,
)
from moe_front_jax.reference.routing import (
    RENORM_EPSILON,
    group_scores,
    kept_groups,
    ordered_key,
    permutation,
    route,
    routing_weights,
    select,
    softmax_scores,
    top_k_of_keys,
    tree_sum,
)
from moe_front_jax.reference.shared import (
    activation,
    round_to_bfloat16,
    shared_down,
    shared_expert,
    shared_hidden,
    silu_gate,
    situ,
)

__all__ = [
    "E4M3_MAX",
    "RENORM_EPSILON",
    "activation",
    "e8m0_scale_down",
    "front_gate_up",
    "front_gemm",
    "front_gemm_plan",
    "group_scores",
    "kept_groups",
    "mailbox",
    "mxfp8_plan",
    "ordered_key",
    "permutation",
    "plan_scale_exponent",
    "round_to_bfloat16",
    "route",
    "routing_weights",
    "select",
    "shared_down",
    "shared_expert",
    "shared_hidden",
    "silu_gate",
    "situ",
    "softmax_scores",
    "top_k_of_keys",
    "tree_sum",
]
