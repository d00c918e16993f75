"""Shared pieces of the front-GEMM tuner and benchmark (GPU only): shapes, rotated weights, CUPTI.

Times are CUPTI kernel times (every kernel a call launches, summed), per call, over weight copies
rotated past the 60 MB L2: each call reads a weight no earlier call left in cache, as a decode step
reads each layer's weight once.
"""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import moe_front_jax as mf
from moe_front_jax import params as mfp

ROTATION_BYTES = 256 << 20
"""Weight copies per shape add up to at least this (over 4x the L2)."""
READ_CEILING_TBS = 4.65
"""Measured HBM read ceiling of the H200 (GPU.md): the floor is the weight bytes over it."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """One rank's front GEMM for K3 at ``tp``."""

    tp: int
    valid: int
    split: int
    shard: int
    hidden: int

    @classmethod
    def k3(cls, tp: int) -> Shape:
        cfg = mf.KIMI_K3.with_tp(tp)
        valid, shard = cfg.experts_per_rank, cfg.latent_per_rank
        return cls(tp, valid, mfp.padded_split(valid), shard, cfg.hidden)

    @property
    def rows(self) -> int:
        return self.split + self.shard

    @property
    def weight_bytes(self) -> int:
        """Bytes a kernel that skips the padding rows reads (the floor's numerator)."""
        return 2 * (self.valid + self.shard) * self.hidden

    @property
    def packed_bytes(self) -> int:
        return 2 * self.rows * self.hidden

    def floor_us(self) -> float:
        return self.weight_bytes / (READ_CEILING_TBS * 1e12) * 1e6


def packed_weights(shape: Shape, seed: int = 0) -> list[jax.Array]:
    """Copies of a random packed weight ``[rows, H]`` (normal / sqrt(H), zero padding rows), enough of
    them to exceed ``ROTATION_BYTES``; each copy is a distinct buffer with distinct values."""
    copies = max(2, -(-ROTATION_BYTES // shape.packed_bytes))
    key = jax.random.key(seed)
    pad = jnp.arange(shape.rows)
    pad = ((pad < shape.valid) | (pad >= shape.split))[:, None]

    @jax.jit
    def one(k):
        w = jax.random.normal(k, (shape.rows, shape.hidden), jnp.float32) / np.sqrt(shape.hidden)
        return jnp.where(pad, w, 0).astype(jnp.bfloat16)

    return [one(k) for k in jax.random.split(key, copies)]


LOGITS_RTOL = 1e-5
"""The logits' bound against a float64 product (issue 4), relative to ``max(|y|, the row's RMS)``;
the latent's is one bfloat16 ulp at that magnitude. The GPU test holds the kernel to the same."""


def float64_product(x: jax.Array, w: jax.Array) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def contract_errors(logits, latent, y: np.ndarray, split: int) -> tuple[float, float]:
    """(logits, latent) errors against the float64 product ``y`` ``[B, rows]``, in units of their
    bounds: the largest ``|err| / (LOGITS_RTOL * mag)`` and ``|err| / ulp_bf16(mag)``, with ``mag =
    max(|y|, the row's RMS)``; both at most 1 within the contract."""
    mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
    valid = logits.shape[1]
    err_l = np.abs(np.asarray(logits, np.float64) - y[:, :valid]) / (LOGITS_RTOL * mag[:, :valid])
    ulp = np.exp2(np.floor(np.log2(np.maximum(mag[:, split:], 2.0**-126))) - 7)
    err_t = np.abs(np.asarray(latent.astype(jnp.float32), np.float64) - y[:, split:]) / ulp
    return float(err_l.max()), float(err_t.max())


def decode_rows(batch: int, hidden: int, seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, hidden), jnp.float32).astype(jnp.bfloat16)


def cupti_us_per_call(fn, x, weights, rounds: int = 2) -> tuple[float, list[str]]:
    """Median over calls of the summed CUPTI kernel time of ``fn(x, w)``, rotating ``weights``.

    ``fn`` is compiled; it is called ``rounds * len(weights)`` times. Returns (microseconds, the names
    of the kernels one call launches).
    """
    per_kernel = cupti_us_per_kernel(fn, x, weights, rounds)
    return statistics.median(map(sum, zip(*per_kernel.values()))), list(per_kernel)


def cupti_us_per_kernel(fn, x, weights, rounds: int = 2, attempts: int = 3
                        ) -> dict[str, list[float]]:
    """The CUPTI time of each kernel ``fn(x, w)`` launches, in launch order: name -> microseconds
    per call, over ``rounds * len(weights)`` calls rotating ``weights``.

    CUPTI also records kernels that other threads launch meanwhile (XLA autotuning the variants a
    tuner compiles beside the timing): where the calls' records then disagree (their count is not a
    multiple of the calls, or a call's kernel names differ from the first call's), the calls are
    timed again, up to ``attempts`` times in all."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # GPU jaxlib only

    jax.block_until_ready(fn(x, weights[0]))
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    calls = rounds * len(weights)
    for _ in range(attempts):
        ext._cupti_init()
        try:
            outs = [fn(x, weights[i % len(weights)]) for i in range(calls)]
            jax.block_until_ready(outs)
        finally:
            timings = ext._cupti_get_timings(True)
        if timings and len(timings) % calls == 0:
            per = len(timings) // calls
            names = [name for name, _ in timings[:per]]
            if all([name for name, _ in timings[c * per:(c + 1) * per]] == names
                   for c in range(calls)):
                break
    else:
        raise RuntimeError(f"{len(timings or [])} kernels over {calls} calls, {attempts} times")
    if len(set(names)) < per:  # the same kernel twice a call: number the repeats
        names = [f"{name}#{i}" for i, name in enumerate(names)]
    return {name: [timings[c * per + i][1] * 1e3 for c in range(calls)]
            for i, name in enumerate(names)}


def vector_schedules(tiles, k: int, parts: int, batch: int, cores: int = 132
                     ) -> list[tuple[int, int, int]]:
    """``(block_rows, block_k, num_warps)`` of the vector schedules worth timing for a batch of at
    most ``streaming.VECTOR_MAX_BATCH``: 1 to 16 rows per program where ``tiles(rows)`` programs give
    every one of ``cores`` SMs one; K steps of 256 to 1024 that divide ``k`` (one to four 16-byte
    loads a thread per row); 2, 4 or 8 warps; at most 64 float32 accumulator registers a thread
    (``parts`` row blocks x ``batch`` rows x ``block_rows x block_k`` over the threads)."""
    return [(bn, bk, warps)
            for bn in (1, 2, 4, 8, 16) if tiles(bn) >= cores
            for bk in (256, 512, 1024) if k % bk == 0
            for warps in (2, 4, 8) if parts * batch * bn * bk <= 64 * 32 * warps]


def xla_dot(x, w):
    """XLA's ``dot_general`` over the packed weight, bf16 x bf16 -> f32 (GPU.md's anchor)."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def tbs(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12
