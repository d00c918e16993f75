"""Exact comparison by bit pattern: arrays as unsigned integers of their width (on the host or
inside a traced function), the MXFP8 plan as bytes, and assertions that dtype, shape and every bit
agree."""

import jax
import numpy as np

UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}
"""The unsigned integer type of each element width in bytes."""


def bits(a) -> np.ndarray:
    """``a``'s bit pattern as a numpy array of unsigned integers of its width (bfloat16 as uint16,
    float32 and int32 as uint32, float8 as uint8), its shape kept: NaN payloads and -0 compare."""
    a = np.asarray(a)
    return a.view(UNSIGNED[a.dtype.itemsize])


def traced_bits(a: jax.Array) -> jax.Array:
    """``bits`` inside a traced function (``jit``, ``shard_map``): a bitcast to the unsigned type of
    ``a``'s width."""
    return jax.lax.bitcast_convert_type(a, UNSIGNED[a.dtype.itemsize])


def plan_bytes(plan) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP8 plan ``(values [B, L] float8_e4m3fn, scales [B, L / block] float8_e8m0fnu)`` as its
    two uint8 arrays."""
    values, scales = plan
    return np.asarray(values).view(np.uint8), np.asarray(scales).view(np.uint8)


def assert_bits_equal(got, want) -> None:
    """``got`` and ``want`` (arrays or scalars) of one dtype and shape, byte for byte."""
    got, want = np.atleast_1d(np.asarray(got)), np.atleast_1d(np.asarray(want))
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype,
                                                                 want.shape)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def assert_each_bits_equal(got, want) -> None:
    """``assert_bits_equal`` on each pair of two sequences of arrays of one length."""
    for g, w in zip(got, want, strict=True):
        assert_bits_equal(g, w)
