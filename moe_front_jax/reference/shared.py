"""The shared expert (SPEC section 6): gate/up, the activation (situ or SiLU), down, on one rank's slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moe_front_jax.config import FrontConfig
from moe_front_jax.reference.dot import rows_dot


def round_to_bfloat16(y: jax.Array) -> jax.Array:
    """Float32 ``y`` rounded to bfloat16 (nearest even), rounded for good.

    A plain cast is not enough where the value is upcast again in the same XLA fusion (situ's first
    step): XLA's excess precision (on by default) may drop that float32 -> bfloat16 -> float32 round
    trip, and the activation then sees unrounded values (seen on the H200 in the TMA schedule's
    split-K epilogue: a third of ``hidden`` 1 ulp off). ``lax.reduce_precision`` is kept.
    """
    return lax.reduce_precision(y, exponent_bits=8, mantissa_bits=7).astype(jnp.bfloat16)


def situ(gate: jax.Array, up: jax.Array, beta: float, linear_beta: float) -> jax.Array:
    """Shared-expert activation on bfloat16 ``gate`` and ``up`` (SPEC section 6), bfloat16 out.

    ``bf16(beta * tanh(gate / beta) * sigmoid(gate) * linear_beta * tanh(up / linear_beta))`` with the
    arithmetic in float32.
    """
    g32, u32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    g = jnp.float32(beta) * jnp.tanh(g32 / jnp.float32(beta)) * jax.nn.sigmoid(g32)
    u = jnp.float32(linear_beta) * jnp.tanh(u32 / jnp.float32(linear_beta))
    return (g * u).astype(jnp.bfloat16)


def silu_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The SiLU-gated activation on bfloat16 ``gate`` and ``up`` (SPEC section 6), bfloat16 out:
    ``bf16(gate * sigmoid(gate) * up)`` with the arithmetic in float32."""
    g32 = gate.astype(jnp.float32)
    return (g32 * jax.nn.sigmoid(g32) * up.astype(jnp.float32)).astype(jnp.bfloat16)


def activation(gate: jax.Array, up: jax.Array, cfg: FrontConfig) -> jax.Array:
    """``cfg.activation`` on bfloat16 ``gate`` and ``up``: ``situ`` or ``silu_gate``."""
    if cfg.activation == "silu":
        return silu_gate(gate, up)
    return situ(gate, up, cfg.situ_beta, cfg.linear_beta)


def shared_hidden(x: jax.Array, gate_up: jax.Array, cfg: FrontConfig) -> jax.Array:
    """The shared expert's first half: ``activation(bf16(x @ gate.T), bf16(x @ up.T))`` ``[B, S_r]``
    bfloat16, from ``x`` ``[B, H]`` and ``gate_up`` ``[2 S_r, H]`` (gate rows, then up rows), float32
    accumulation."""
    s_r = gate_up.shape[0] // 2
    h = rows_dot(x, gate_up)
    gate, up = round_to_bfloat16(h[:, :s_r]), round_to_bfloat16(h[:, s_r:])
    return activation(gate, up, cfg)


def shared_down(
    hidden: jax.Array, down: jax.Array, out_dtype: jnp.dtype = jnp.bfloat16
) -> jax.Array:
    """The shared expert's second half: ``hidden @ down.T`` ``[B, H]`` in ``out_dtype`` from
    ``hidden`` ``[B, S_r]`` and ``down`` ``[H, S_r]``, float32 accumulation."""
    out = rows_dot(hidden, down)
    return out.astype(out_dtype)


def shared_expert(
    x: jax.Array, gate_up: jax.Array, down: jax.Array, cfg: FrontConfig,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """The shared expert on one rank's slice (SPEC section 6); a partial sum when ``cfg.tp > 1``.

    Args:
      x: ``[B, H]`` bfloat16.
      gate_up: ``[2 S_r, H]`` bfloat16, this rank's gate rows then its up rows (``S_r = S / tp``).
      down: ``[H, S_r]`` bfloat16, this rank's columns of the down projection.
      cfg: supplies ``activation``, ``situ_beta`` and ``linear_beta``.
      out_dtype: bfloat16 (the SPEC's output) or float32 (a partial sum to reduce before rounding).

    Returns:
      ``[B, H]`` ``out_dtype``: ``shared_down(shared_hidden(x, gate_up, cfg), down, out_dtype)``.
    """
    return shared_down(shared_hidden(x, gate_up, cfg), down, out_dtype)
