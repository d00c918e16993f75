"""The streaming engine's test cases, shared by its tests and the layer kernel's: interpret mode's
small shapes, exact data (every float32 partial sum exact, so any summation order gives the float64
product bit for bit) and its checks, and K3's zero operands for lowering."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.params import padded_split
from bitwise import bits

K3 = mf.KIMI_K3
HIDDEN, VALID, SPLIT, SHARD, S_R = 256, 64, 80, 128, 64
"""Interpret mode's small shapes: H, router rows, split (16 zero rows after them), latent rows,
shared rows per rank."""
SMALL = mf.FrontConfig(hidden=HIDDEN, experts=VALID, top_k=8, latent=SHARD, shared=S_R)


def exact_rows(rng, rows, hidden, low, high):
    """Small-integer rows scaled by powers of two from ``2**low`` to ``2**high``: every float32
    partial sum of a product with small-integer ``x`` is exact, so any summation order gives the
    float64 product bit for bit."""
    w = rng.integers(-3, 4, (rows, hidden)).astype(np.float32)
    return w * np.exp2(rng.integers(low, high + 1, (rows, 1)))


def exact_front(batch, seed=0, hidden=HIDDEN, valid=VALID, split=SPLIT, shard=SHARD, pad=0.0):
    """``x`` and ``packed``: exact data, the rows between valid and split ``pad``. The latent rows
    span binades from ``2**-12`` to ``2**12``, so the plan's scales differ block to block."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (batch, hidden)).astype(np.float32)
    w = exact_rows(rng, split + shard, hidden, -12, 12)
    w[valid:split] = pad
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


def exact_gate_up(s_r, seed=1, hidden=HIDDEN):
    """Gate and up rows whose products with ``x`` span the range where tanh and the sigmoid bend."""
    return jnp.asarray(exact_rows(np.random.default_rng(seed), 2 * s_r, hidden, -9, -2),
                       jnp.bfloat16)


def product(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def assert_front_exact(logits, latent, y, valid=VALID, split=SPLIT):
    np.testing.assert_array_equal(np.asarray(logits), y[:, :valid].astype(np.float32))
    np.testing.assert_array_equal(bits(latent),
                                  y[:, split:].astype(ml_dtypes.bfloat16).view(np.uint16))


def situ_of(h, s_r):
    """``reference.situ`` of the bfloat16-rounded gate and up of the exact product ``h``."""
    gate, up = (jnp.asarray(h[:, p * s_r:(p + 1) * s_r].astype(ml_dtypes.bfloat16))
                for p in range(2))
    return reference.situ(gate, up, SMALL.situ_beta, SMALL.linear_beta)


def close_to_float64(got, y, tol):
    """``got`` within ``tol`` of ``y`` relative to each value's magnitude, at least its row's
    RMS."""
    mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
    return (np.abs(np.asarray(got, np.float64) - y) <= tol * mag).all()


def k3_arrays(tp, batch):
    cfg = K3.with_tp(tp)
    valid, shard, s_r = cfg.experts_per_rank, cfg.latent_per_rank, cfg.shared_per_rank
    split = padded_split(valid)
    return (cfg, valid, split, jnp.zeros((batch, K3.hidden), jnp.bfloat16),
            jnp.zeros((split + shard, K3.hidden), jnp.bfloat16),
            jnp.zeros((2 * s_r, K3.hidden), jnp.bfloat16),
            jnp.zeros((batch, s_r), jnp.bfloat16), jnp.zeros((K3.hidden, s_r), jnp.bfloat16))
