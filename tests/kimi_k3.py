"""Kimi-K3's seeded weights for the GPU tests, made once a process: the front GEMM's, shared
expert's, engine's and layer kernel's tests share them."""

import functools

import jax

import moe_front_jax as mf


@functools.cache
def k3_weights(shared: bool | None = None) -> dict[str, jax.Array]:
    """``mf.init_weights(jax.random.key(0), KIMI_K3, shared)``: with the shared expert's weights
    unless ``shared`` is False."""
    return mf.init_weights(jax.random.key(0), mf.KIMI_K3, shared=shared)
