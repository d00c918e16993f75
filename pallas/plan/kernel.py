"""The MXFP8 plan of a latent as one Pallas Triton kernel (SPEC section 5), and its tile math.

``plan(latent, block)`` quantizes each row of ``latent`` ``[B, L]`` bfloat16 in blocks of ``block``
elements, as ``reference.mxfp8_plan`` does, bit for bit:

    amax   = max |v| over the block                  (integer max of the magnitude bits)
    scale  = amax / 448 rounded up to a power of two  E8M0 byte ``reference.plan_scale_exponent``
    values = e4m3(clamp(v * (1 / scale), -448, 448))  round to nearest even; inverse 0 for byte 0

returning values float8_e4m3fn ``[B, L]`` and scales float8_e8m0fnu ``[B, L / block]``. The tile math
(``quantize_tile``, ``quantize_word_tile``) also serves the front GEMM's epilogue
(``moe_front_jax.pallas.front_gemm``) and ``pallas/route_collect/kernel.py``; this kernel plans a
latent that arrives otherwise (the plain collect, tensor parallelism's all-gather).

Schedule: ``[B, L]`` viewed as ``B * L / width`` contiguous segments (``width`` a power-of-two
multiple of ``block`` dividing ``L``: 512 for K3 at tp1, 64 at tp8); a program quantizes
``block_rows`` segments with one load, a block max, one store of values and one of scale bytes. No
loop: at decode batches it is one wave. Triton has no E8M0 type, so scales are written as bytes and
bitcast by XLA (no kernel).

Cost per call (``plan_bytes``, ``n = B * L``): 2n read + n values + n / block scale bytes, 10.9 KB a
row at tp1. FLOPs: about 6n, no tensor cores. No tuning table ships: a schedule sweep barely beat
``heuristic_config`` (docs/findings.md, MXFP8 plan).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_front_jax import reference
from moe_front_jax.pallas.device import core_count

MAX_WIDTH = 512
"""Widest segment, in elements: K3's tp1 latent (3584 = 7 * 512) is 7 segments a row."""
MAX_TILE = 8192
"""Most elements one program holds (16 KB of bf16: 32 registers a thread at 8 warps)."""


def magnitude_bits(blocks: jax.Array) -> jax.Array:
    """The int32 bits of ``|v|`` for float32 ``blocks``: their integer max is the block's amax (float
    order for numbers, and NaN above infinity as in XLA)."""
    return lax.bitcast_convert_type(blocks, jnp.int32) & 0x7FFFFFFF


def to_e4m3(blocks: jax.Array, exponent: jax.Array) -> jax.Array:
    """float32 ``blocks`` scaled down by their E8M0 ``exponent`` (broadcast against them), clamped to
    +-448 and rounded to float8_e4m3fn (nearest even)."""
    scaled = reference.e8m0_scale_down(blocks, exponent)
    # Selects rather than min/max: Triton's float min/max drop NaN, the reference keeps it.
    top = reference.E4M3_MAX
    scaled = jnp.where(scaled > top, top, jnp.where(scaled < -top, -top, scaled))
    return scaled.astype(jnp.float8_e4m3fn)


def quantize_tile(latent: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """The MXFP8 plan of a tile of latent rows, inside a Pallas kernel (or anywhere in JAX).

    Args:
      latent: ``[rows, cols]`` bfloat16, ``cols`` a multiple of ``block``; each run of ``block``
        columns of a row is one MXFP8 block.
      block: elements per scale.

    Returns:
      ``values`` ``[rows, cols]`` float8_e4m3fn and ``scales`` ``[rows, cols / block]`` uint8 (E8M0
      bytes: Triton has no E8M0 type), bit-equal to ``reference.mxfp8_plan`` of the same rows.
    """
    rows, cols = latent.shape
    # Blocks along the minor axis: each is a run of one row's registers, no layout shuffle.
    blocks = latent.astype(jnp.float32).reshape(rows, cols // block, block)
    exponent = reference.plan_scale_exponent(jnp.max(magnitude_bits(blocks), axis=2))
    values = to_e4m3(blocks, exponent[:, :, None]).reshape(rows, cols)
    return values, exponent.astype(jnp.uint8)


def quantize_word_tile(words: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """``quantize_tile`` of latent columns packed in pairs into uint32 words (the mailbox's layout).

    Args:
      words: ``[rows, n]`` uint32, word ``i`` holding bfloat16 columns ``2i`` (low half) and ``2i + 1``
        (high half); ``n`` a multiple of ``block / 2``.
      block: elements per scale, at least 2.

    Returns:
      ``values`` ``[rows, n]`` uint16, word ``i`` holding the float8_e4m3fn bytes of columns ``2i``
      (low byte) and ``2i + 1``, and ``scales`` ``[rows, 2n / block]`` uint8, the same bits as
      ``quantize_tile`` of the unpacked columns.
    """
    rows, n = words.shape
    shape = (rows, 2 * n // block, block // 2)
    # A bfloat16 is the high half of the float32 it widens to: no conversion, a shift or a mask.
    low = lax.bitcast_convert_type(words << 16, jnp.float32).reshape(shape)
    high = lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32).reshape(shape)
    amax = jnp.max(jnp.maximum(magnitude_bits(low), magnitude_bits(high)), axis=2)
    exponent = reference.plan_scale_exponent(amax)[:, :, None]

    def byte(blocks):
        e4m3 = to_e4m3(blocks, exponent).reshape(rows, n)
        return lax.bitcast_convert_type(e4m3, jnp.uint8).astype(jnp.uint16)

    return byte(low) | (byte(high) << 8), exponent[:, :, 0].astype(jnp.uint8)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """Schedule of the plan kernel.

    Attributes:
      width: elements per segment, a power-of-two multiple of the plan block that divides ``L``.
      block_rows: segments per program, a power of two.
      num_warps: Triton warps per program, a power of two.
    """

    width: int
    block_rows: int
    num_warps: int

    def __post_init__(self):
        for name in ("width", "block_rows", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"PlanConfig.{name} must be a power of two >= 1, got {value!r}")


def widest_segment(latent: int, block: int) -> int:
    """The largest power-of-two multiple of ``block`` that divides ``latent``, at most
    ``max(block, MAX_WIDTH)``."""
    width = block
    while width * 2 <= MAX_WIDTH and latent % (width * 2) == 0:
        width *= 2
    return width


def heuristic_config(batch: int, latent: int, block: int, cores: int) -> PlanConfig:
    """The widest segment; as many segments per program as keep every one of ``cores`` SMs busy
    (one where there are fewer segments than SMs), at most ``MAX_TILE`` elements; a warp per 256
    elements (8 per thread), between 1 and 8."""
    width = widest_segment(latent, block)
    segments = batch * latent // width
    block_rows = 1
    while block_rows * 2 * cores <= segments and block_rows * 2 * width <= MAX_TILE:
        block_rows *= 2
    num_warps = max(1, min(8, block_rows * width // 256))
    return PlanConfig(width, block_rows, num_warps)


def pick_config(batch: int, latent: int, block: int) -> PlanConfig:
    """``heuristic_config`` for the target device's SM count."""
    return heuristic_config(batch, latent, block, core_count())


def plan_bytes(batch: int, latent: int, block: int) -> int:
    """Bytes one call moves (the docstring's count): the latent read, values and scale bytes written."""
    n = batch * latent
    return 2 * n + n + n // block


def _kernel(latent_ref, values_ref, scales_ref, *, segments: int, config: PlanConfig, block: int):
    rows = config.block_rows
    first = pl.program_id(0) * rows
    # A mask only where the last program runs past the segments: else plain 16-byte vectors.
    row_ok = (first + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) < segments
    mask = row_ok if segments % rows else None
    latent = plgpu.load(
        latent_ref.at[pl.ds(first, rows), :], mask=mask, other=None if mask is None else 0.0
    )
    values, scales = quantize_tile(latent, block)
    plgpu.store(values_ref.at[pl.ds(first, rows), :], values, mask=mask)
    plgpu.store(scales_ref.at[pl.ds(first, rows), :], scales, mask=mask)


def _check(latent, block) -> None:
    shape = getattr(latent, "shape", None)
    if shape is None or len(shape) != 2 or latent.dtype != jnp.bfloat16:
        raise ValueError(
            f"latent must be a 2-D bfloat16 array [B, L], got {shape} {getattr(latent, 'dtype', None)}"
        )
    if shape[0] == 0:
        raise ValueError(f"latent is an empty batch (shape {tuple(shape)}); B must be >= 1")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 1, got {block!r}")
    if shape[1] % block:
        raise ValueError(f"latent's width L={shape[1]} must be a multiple of block={block}")


def covers(latent, block) -> None:
    """Raise ``ValueError`` where the arguments are wrong; the kernel covers every valid request."""
    _check(latent, block)


def plan(
    latent: jax.Array,
    block: int = 32,
    *,
    interpret: bool = False,
    config: PlanConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MXFP8 plan of ``latent`` (SPEC section 5), one Pallas kernel.

    Args:
      latent: ``[B, L]`` bfloat16, ``B >= 1``; block: elements per E8M0 scale, a power of two
        dividing ``L``; config: the schedule (None: ``heuristic_config`` for the target device).
      interpret: run in Pallas' interpret mode (any machine).

    Returns:
      ``values`` ``[B, L]`` float8_e4m3fn and ``scales`` ``[B, L / block]`` float8_e8m0fnu, bit-equal
      to ``reference.mxfp8_plan(latent, block)``.

    Raises:
      ValueError: ``latent`` not 2-D bfloat16, an empty batch, a ``block`` that is not a power of two
        or does not divide ``L``, a config whose ``width`` is not a multiple of ``block`` dividing
        ``L``.
    """
    _check(latent, block)
    batch, width_l = latent.shape
    config = config or pick_config(batch, width_l, block)
    if not isinstance(config, PlanConfig):
        raise ValueError(f"config must be a PlanConfig or None, got {type(config).__name__}")
    if config.width % block or width_l % config.width:
        raise ValueError(
            f"config.width={config.width} must be a multiple of block={block} that divides "
            f"L={width_l}"
        )
    segments = batch * width_l // config.width
    values, scales = pl.pallas_call(
        functools.partial(_kernel, segments=segments, config=config, block=block),
        out_shape=[
            jax.ShapeDtypeStruct((segments, config.width), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((segments, config.width // block), jnp.uint8),
        ],
        grid=(pl.cdiv(segments, config.block_rows),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="mxfp8_plan",
    )(latent.reshape(segments, config.width))
    scales = lax.bitcast_convert_type(scales.reshape(batch, width_l // block), jnp.float8_e8m0fnu)
    return values.reshape(batch, width_l), scales
