"""The MXFP8 plan of the latent (SPEC section 5): E8M0 scales per block of 32, float8_e4m3fn values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value; the MXFP8 scale maps a block's amax onto it."""


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
