"""The pure-JAX reference of every stage of the MoE front (SPEC.md sections 3-6).

Plain ``jax.numpy``/``lax``, exact to the SPEC: the oracle every kernel is tested against and the CPU
backend users get. Each function works on one device's arrays; tensor parallelism (the exchange and the
shared expert's reduction) lives in ``moe_front_jax.parallel``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moe_front_jax.config import FrontConfig

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value; the MXFP8 scale maps a block's amax onto it."""
RENORM_EPSILON = 1e-20
"""Added to the weight sum before the division, so an all-zero selection gives zero weights."""


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
    y = lax.dot_general(x, packed, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
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


def ordered_key(value: jax.Array) -> jax.Array:
    """Monotone uint32 image of float32 ``value``; NaN maps to 0, below every number.

    ``~bits`` where the sign bit is set, else ``bits | 0x80000000`` (SPEC section 4 step 2). Note that
    ``-0.0`` orders just below ``+0.0``.
    """
    bits = lax.bitcast_convert_type(value.astype(jnp.float32), jnp.uint32)
    negative = (bits & jnp.uint32(0x80000000)) != 0
    key = jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))
    return jnp.where(jnp.isnan(value), jnp.uint32(0), key)


def tree_sum(values: jax.Array) -> jax.Array:
    """Pairwise tree sum over the last axis, as a butterfly over lanes ``0..K-1`` adds.

    ``((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7))...`` in float32; a K that is not a power of two is padded
    with zeros up to the next one (the idle lanes of the butterfly).
    """
    k = values.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    if width != k:
        pad = [(0, 0)] * (values.ndim - 1) + [(0, width - k)]
        values = jnp.pad(values, pad)
    while values.shape[-1] > 1:
        values = values[..., 0::2] + values[..., 1::2]
    return values[..., 0]


def routing_weights(chosen_scores: jax.Array, cfg: FrontConfig) -> jax.Array:
    """bfloat16 weights from the chosen experts' unbiased sigmoids ``[B, K]`` (SPEC section 4 step 4).

    NaN scores weigh 0 and stay out of the sum; with ``renormalize`` each weight is
    ``bf16((w * scale) / (tree_sum(w) + 1e-20))`` in float32, else ``bf16(w * scale)``.
    """
    w = jnp.where(jnp.isnan(chosen_scores), jnp.float32(0), chosen_scores.astype(jnp.float32))
    scaled = w * jnp.float32(cfg.routed_scaling_factor)
    if cfg.renormalize:
        total = tree_sum(w)[..., None] + jnp.float32(RENORM_EPSILON)
        # XLA's simplifier turns a division by a broadcast into a multiplication by its reciprocal,
        # which rounds differently from the correctly rounded division the SPEC asks for; the
        # barrier keeps the full-shape denominator opaque to that rewrite.
        denominator = lax.optimization_barrier(jnp.broadcast_to(total, scaled.shape))
        scaled = scaled / denominator
    return scaled.astype(jnp.bfloat16)


def route(
    logits: jax.Array, bias: jax.Array, cfg: FrontConfig
) -> tuple[jax.Array, jax.Array]:
    """Exact top-k routing by sigmoid + correction bias (SPEC section 4).

    Args:
      logits: ``[B, E]`` float32 router logits (all experts, every rank's shard).
      bias: ``[E]`` float32 ``e_score_correction_bias``.
      cfg: supplies ``top_k``, ``routed_scaling_factor`` and ``renormalize``.

    Returns:
      ``ids`` ``[B, K]`` int32, rank 0 the largest key, ties to the lower expert id, NaN keys lowest;
      ``weights`` ``[B, K]`` bfloat16 from the unbiased sigmoids.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    keys = ordered_key(scores + bias.astype(jnp.float32))
    # top_k breaks ties by the lower index; int32 (ordered ^ sign bit) keeps the order of uint32.
    signed = lax.bitcast_convert_type(keys ^ jnp.uint32(0x80000000), jnp.int32)
    _, ids = lax.top_k(signed, cfg.top_k)
    chosen = jnp.take_along_axis(scores, ids, axis=-1)
    return ids.astype(jnp.int32), routing_weights(chosen, cfg)


def plan_scale_exponent(amax_bits: jax.Array) -> jax.Array:
    """Biased E8M0 exponent of ``amax / 448`` rounded toward +inf, from the float32 bits of a
    bfloat16-exact ``amax >= 0`` (int32 or uint32 bits; the result has their dtype).

    The smallest ``b`` in ``[0, 254]`` with ``2**(b - 127) >= amax / 448``, computed without the
    division (XLA on CPU flushes a subnormal quotient to zero, and Triton's float32 division is
    approximate). With ``amax = 1.m * 2**(E - 127)`` and ``448 = 1.75 * 2**8`` the quotient is
    ``(1.m / 1.75) * 2**(E - 135)``: rounded up to a power of two it is ``2**(E - 135)`` when
    ``1.m <= 1.75`` and twice that above, so ``b = E - 8 + (m > 0.75)``, clamped at 0 (quotients up
    to 2**-127, zero and subnormal amax included) and 254 (infinity and NaN). A bfloat16 mantissa has
    7 bits, so the quotient is never within a rounding of a power of two it does not equal.
    """
    exponent = (amax_bits >> 23) & 0xFF
    above = jnp.where((amax_bits & 0x7FFFFF) > 0x600000, 1, 0).astype(amax_bits.dtype)
    biased = jnp.maximum(exponent.astype(jnp.int32) - 8 + above.astype(jnp.int32), 0)
    return jnp.where(exponent == 0xFF, 254, biased).astype(amax_bits.dtype)


def e8m0_scale_down(values: jax.Array, exponent: jax.Array) -> jax.Array:
    """``values * inverse`` for biased E8M0 ``exponent`` (broadcast against ``values``).

    The scale decodes as the float32 whose exponent field is the byte, so byte 0 decodes to 0 and
    gets inverse 0; otherwise ``inverse = 2**(127 - b)``. At b = 254 that inverse, 2**-127, is a
    float32 subnormal that flush-to-zero arithmetic would lose (and turn inf * 0 into NaN), so it is
    applied as two normal factors, 2**-64 * 2**-63.
    """
    b = exponent.astype(jnp.uint32)
    top = b == 254
    # 2**(127 - b) has exponent field 254 - b; for b = 254 use 2**-64 (field 63) then 2**-63.
    first = lax.bitcast_convert_type(jnp.where(top, jnp.uint32(63), 254 - b) << 23, jnp.float32)
    first = jnp.where(b == 0, jnp.float32(0), first)
    second = jnp.where(top, jnp.float32(2.0**-63), jnp.float32(1))
    return values * first * second


def mxfp8_plan(latent: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """MXFP8 copy of the latent in blocks of ``block`` elements (SPEC section 5).

    Args:
      latent: ``[B, L]`` bfloat16.
      block: elements per scale.

    Returns:
      ``values`` ``[B, L]`` float8_e4m3fn, ``float8_e4m3fn(clamp(v * inverse, -448, 448))`` rounded to
      nearest even, and ``scales`` ``[B, L / block]`` float8_e8m0fnu, ``amax / 448`` rounded up to a
      power of two (``plan_scale_exponent``); ``v * inverse`` as ``e8m0_scale_down`` computes it.

    Raises:
      ValueError: ``latent`` not ``[B, L]`` bfloat16 with ``L`` a multiple of ``block``.
    """
    shape = getattr(latent, "shape", None)
    if shape is None or len(shape) != 2 or latent.dtype != jnp.bfloat16:
        got = f"{tuple(shape)} {latent.dtype}" if shape is not None else f"a {type(latent).__name__}"
        raise ValueError(f"mxfp8_plan: latent must be a [B, L] bfloat16 array, got {got}")
    if shape[1] % block:
        raise ValueError(f"mxfp8_plan: latent's width L={shape[1]} must be a multiple of "
                         f"block={block}")
    rows, width = latent.shape
    blocks = latent.astype(jnp.float32).reshape(rows, width // block, block)
    # amax as the integer max of |v|'s bits: float order for numbers and NaN above infinity. A float
    # max is not safe here: XLA's CPU reductions lose a NaN in their vectorized loops.
    magnitude = lax.bitcast_convert_type(blocks, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    exponent = plan_scale_exponent(jnp.max(magnitude, axis=-1)).astype(jnp.uint8)
    scaled = jnp.clip(e8m0_scale_down(blocks, exponent[..., None]), -E4M3_MAX, E4M3_MAX)
    values = scaled.reshape(rows, width).astype(jnp.float8_e4m3fn)
    scales = lax.bitcast_convert_type(exponent, jnp.float8_e8m0fnu)
    return values, scales


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


def shared_expert(
    x: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    cfg: FrontConfig,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """The shared expert on one rank's slice (SPEC section 6); a partial sum when ``cfg.tp > 1``.

    Args:
      x: ``[B, H]`` bfloat16.
      gate_up: ``[2 S_r, H]`` bfloat16, this rank's gate rows then its up rows (``S_r = S / tp``).
      down: ``[H, S_r]`` bfloat16, this rank's columns of the down projection.
      cfg: supplies ``situ_beta`` and ``linear_beta``.
      out_dtype: bfloat16 (the SPEC's output) or float32 (a partial sum to reduce before rounding).

    Returns:
      ``[B, H]`` ``out_dtype``: ``hidden @ down.T`` with float32 accumulation.
    """
    s_r = gate_up.shape[0] // 2
    h = lax.dot_general(x, gate_up, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    gate, up = round_to_bfloat16(h[:, :s_r]), round_to_bfloat16(h[:, s_r:])
    hidden = situ(gate, up, cfg.situ_beta, cfg.linear_beta)
    out = lax.dot_general(hidden, down, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(out_dtype)
