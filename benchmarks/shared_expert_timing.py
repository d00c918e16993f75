"""Shared pieces of the shared-expert tuner and benchmark (GPU only): shapes and rotated weights.

CUPTI timing and the read ceiling are ``front_gemm_timing``'s: every kernel a call launches, summed,
per call, over weight copies rotated past the 60 MB L2.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import moe_front_jax as mf
from front_gemm_timing import READ_CEILING_TBS, ROTATION_BYTES


@dataclasses.dataclass(frozen=True)
class Shape:
    """One rank's shared expert for K3 at ``tp``: gate_up ``[2 S_r, H]``, down ``[H, S_r]``."""

    tp: int
    shared: int
    hidden: int

    @classmethod
    def k3(cls, tp: int) -> Shape:
        cfg = mf.KIMI_K3.with_tp(tp)
        return cls(tp, cfg.shared_per_rank, cfg.hidden)

    @property
    def cfg(self) -> mf.FrontConfig:
        return mf.KIMI_K3.with_tp(self.tp)

    @property
    def gate_up_bytes(self) -> int:
        return 2 * 2 * self.shared * self.hidden

    @property
    def down_bytes(self) -> int:
        return 2 * self.hidden * self.shared

    @property
    def weight_bytes(self) -> int:
        """The bytes a call must read (the floor's numerator): both weights."""
        return self.gate_up_bytes + self.down_bytes

    def floor_us(self, nbytes: int | None = None) -> float:
        return (nbytes or self.weight_bytes) / (READ_CEILING_TBS * 1e12) * 1e6


def random_copies(shape: tuple[int, int], fan_in: int, nbytes: int, seed: int) -> list[jax.Array]:
    """Copies of a random bf16 weight (normal / sqrt(fan_in)), enough of them to exceed
    ``ROTATION_BYTES`` together (at least two); each a distinct buffer with distinct values."""
    copies = max(2, -(-ROTATION_BYTES // nbytes))

    @jax.jit
    def one(k):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(jnp.bfloat16)

    return [one(k) for k in jax.random.split(jax.random.key(seed), copies)]


def gate_up_copies(s: Shape, seed: int = 0) -> list[jax.Array]:
    return random_copies((2 * s.shared, s.hidden), s.hidden, s.gate_up_bytes, seed)


def down_copies(s: Shape, seed: int = 1) -> list[jax.Array]:
    return random_copies((s.hidden, s.shared), s.shared, s.down_bytes, seed)


def rows(batch: int, width: int, seed: int = 2) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, width), jnp.float32).astype(jnp.bfloat16)
