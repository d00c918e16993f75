"""The one product the reference's GEMMs take: ``a @ w.T`` with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def rows_dot(a: jax.Array, w: jax.Array) -> jax.Array:
    """``a @ w.T`` ``[B, N]`` float32 from ``a`` ``[B, K]`` and ``w`` ``[N, K]``, float32 accumulation.

    Compiling for a CPU (JAX's default backend when traced), one row is padded to two with a zero row
    and the product sliced back: XLA's CPU dot of bfloat16 takes a far slower path at one row than at
    two (docs/findings.md). Row 0 is the same dot product either way, up to float32 summation order.
    """
    rows = a.shape[0]
    pad = rows == 1 and jax.default_backend() == "cpu"
    if pad:
        a = jnp.concatenate([a, jnp.zeros_like(a)])
    y = lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y[:rows] if pad else y
