"""The front GEMM (SPEC section 3): one pass over the packed ``[router; zeros; latent]`` weight;
and the merged front, the same pass beside the shared expert's gate/up (SPEC sections 3, 5 and 6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_front_jax.config import FrontConfig
from moe_front_jax.reference.dot import rows_dot
from moe_front_jax.reference.plan import mxfp8_plan
from moe_front_jax.reference.shared import shared_hidden


def front_gemm(
    x: jax.Array, packed: jax.Array, split: int, valid: int
) -> tuple[jax.Array, jax.Array]:
    """One pass over the packed ``[router rows; zero rows; latent rows]`` weight (SPEC section 3).

    Args:
      x: ``[B, H]`` bfloat16 decode rows.
      packed: ``[n, H]`` bfloat16, ``n = split + shard``; rows ``[0, valid)`` are this rank's router
        rows, ``[valid, split)`` zeros, ``[split, n)`` its latent down-projection rows.
      split: first latent row of ``packed``.
      valid: router rows of this rank (``experts / tp``).

    Returns:
      ``logits`` ``[B, valid]`` float32 and ``latent_shard`` ``[B, n - split]`` bfloat16, both from one
      float32-accumulated product ``x @ packed.T``.
    """
    y = rows_dot(x, packed)
    return y[:, :valid], y[:, split:].astype(jnp.bfloat16)


def front_gemm_plan(
    x: jax.Array, packed: jax.Array, split: int, valid: int, block: int = 32
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """``front_gemm`` and the MXFP8 plan of its latent shard (SPEC sections 3 and 5).

    Returns:
      ``(logits, latent_shard, mxfp8_plan(latent_shard, block))``.
    """
    logits, latent = front_gemm(x, packed, split, valid)
    return logits, latent, mxfp8_plan(latent, block)


def front_gate_up(
    x: jax.Array, packed: jax.Array, split: int, valid: int, gate_up: jax.Array, cfg: FrontConfig,
    *, plan: bool = False,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None, jax.Array]:
    """The merged front: ``front_gemm`` and the shared expert's first half from the same ``x``.

    Args:
      x, packed, split, valid: as ``front_gemm``.
      gate_up: ``[2 S_r, H]`` bfloat16, this rank's gate rows then its up rows.
      cfg: supplies ``situ_beta``, ``linear_beta`` and ``plan_block``.
      plan: also return the latent shard's MXFP8 plan.

    Returns:
      ``(logits, latent_shard, plan_or_None, hidden)``: ``front_gemm``'s two,
      ``mxfp8_plan(latent_shard, cfg.plan_block)`` or None, and ``shared_hidden(x, gate_up, cfg)``
      ``[B, S_r]`` bfloat16.
    """
    logits, latent = front_gemm(x, packed, split, valid)
    planned = mxfp8_plan(latent, cfg.plan_block) if plan else None
    return logits, latent, planned, shared_hidden(x, gate_up, cfg)
