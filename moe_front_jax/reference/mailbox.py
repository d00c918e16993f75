"""The Lamport mailbox's protocol in plain JAX (SPEC section 7): the row layout and publish/collect.

A row per token holds ``L + 2E`` 16-bit columns, stored as uint32 words (little-endian, as the GPU
reads memory): word ``i < L/2`` holds latent columns ``2i`` (low half) and ``2i + 1`` (high half),
word ``L/2 + e`` the float32 bits of logit ``e``; zero words pad a row to whole 16-byte chunks (zero
is not the sentinel, so padding is never waited for). The buffer is ``[generations, capacity,
row_words]`` uint32, control is int32 ``[2]``: the generation the last collect read, then the one the
last publish wrote. A publish writes generation ``(control[0] + 1) mod G``; a collect reads
``control[1]``, copies the rows out and re-arms them with the sentinel ``0x80000000`` (float32 -0.0).
Writers canonicalize so no data word is the sentinel: float32 -0.0 becomes +0.0 and a bfloat16 -0 in
either half of a latent word +0. Routing cannot see it (``sigmoid(-0.0) == sigmoid(+0.0)``); the plan
of a -0 latent value becomes ``0x00`` instead of ``0x80``. A collect that finds a sentinel reports
``TIMEOUT``. Why the immediate re-arm is safe, and the GPU kernels: ``moe_front_jax.mailbox``.

Cost: a publish writes ``4 B (L/2 + E) / tp`` bytes per rank; a collect reads ``4 B (L/2 + E)``
bytes, writes as many out and as many again to re-arm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_front_jax.config import FrontConfig
from moe_front_jax.reference.gemm import front_gemm
from moe_front_jax.reference.plan import mxfp8_plan
from moe_front_jax.reference.routing import route

SENTINEL = 0x80000000
"""The armed word: float32 -0.0. No published data word equals it."""
TIMEOUT = 1
"""Status of a collect that found a chunk still holding the sentinel (after its spin limit)."""
CHUNK_WORDS = 4
"""32-bit words per 16-byte chunk, the unit a reader polls, copies and re-arms."""
CONTROL_WORDS = 2
"""``control``: [generation the last collect read, generation the last publish wrote]."""


def latent_words(cfg: FrontConfig) -> int:
    """Words of a row holding the latent: ``L / 2``."""
    return cfg.latent // 2


def data_words(cfg: FrontConfig) -> int:
    """Words of a row that carry data: ``L / 2 + E``."""
    return latent_words(cfg) + cfg.experts


def row_words(cfg: FrontConfig) -> int:
    """Words of a stored row: ``data_words`` rounded up to whole 16-byte chunks."""
    return -(-data_words(cfg) // CHUNK_WORDS) * CHUNK_WORDS


def armed_row(cfg: FrontConfig) -> np.ndarray:
    """An armed row, ``[row_words]`` uint32: the sentinel in every data word, zero in the padding."""
    row = np.zeros(row_words(cfg), np.uint32)
    row[: data_words(cfg)] = SENTINEL
    return row


def logits_to_words(logits: jax.Array) -> jax.Array:
    """float32 ``[B, n]`` logits as canonical words ``[B, n]`` uint32 (-0.0 becomes +0.0)."""
    words = lax.bitcast_convert_type(logits, jnp.uint32)
    return jnp.where(words == jnp.uint32(SENTINEL), jnp.uint32(0), words)


def latent_word_pairs(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Canonical words (uint32) from bfloat16 latent columns ``2i`` (``lo``) and ``2i + 1`` (``hi``)
    of one shape: the low and high halves, a -0 (``0x8000``) becoming +0."""
    def half(v):
        bits = lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32)
        return jnp.where(bits == jnp.uint32(0x8000), jnp.uint32(0), bits)

    return half(lo) | (half(hi) << 16)


def latent_to_words(latent: jax.Array) -> jax.Array:
    """bfloat16 ``[B, n]`` latent (n even) as canonical words ``[B, n/2]`` uint32."""
    return latent_word_pairs(latent[:, 0::2], latent[:, 1::2])


def words_to_latent(words: jax.Array) -> jax.Array:
    """Words ``[B, n]`` uint32 back to bfloat16 columns ``[B, 2n]`` (inverse of ``latent_to_words``)."""
    halves = jnp.stack([words & jnp.uint32(0xFFFF), words >> 16], axis=-1).astype(jnp.uint16)
    return lax.bitcast_convert_type(halves.reshape(words.shape[0], -1), jnp.bfloat16)


def publish(
    buffer: jax.Array,
    control: jax.Array,
    logits: jax.Array,
    latent_shard: jax.Array,
    rank: int | jax.Array,
    cfg: FrontConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rank ``rank`` writes its logits ``[B, E/tp]`` float32 and latent shard ``[B, L/tp]`` bfloat16,
    canonicalized, into rows ``[0, B)`` of generation ``g = (control[0] + 1) mod G``.

    Returns ``(buffer, control, status)``: ``control[1] = g``, and a zero int32 status (the word the
    GPU kernels' collect polls with; nothing to wait for here).
    """
    generation = (control[0] + 1) % buffer.shape[0]
    latent_at = rank * (cfg.latent_per_rank // 2)
    logits_at = latent_words(cfg) + rank * cfg.experts_per_rank
    buffer = lax.dynamic_update_slice(
        buffer, latent_to_words(latent_shard)[None], (generation, 0, latent_at)
    )
    buffer = lax.dynamic_update_slice(buffer, logits_to_words(logits)[None], (generation, 0, logits_at))
    return buffer, control.at[1].set(generation), jnp.zeros((), jnp.int32)


def collect(
    buffer: jax.Array, control: jax.Array, status: jax.Array, batch: int, cfg: FrontConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Read rows ``[0, batch)`` of generation ``control[1]``, and re-arm them.

    Returns ``(logits [batch, E] float32, latent [batch, L] bfloat16, status, buffer, control)``:
    status is ``TIMEOUT`` where a chunk still held the sentinel, else ``status`` as given;
    ``control[0]`` becomes the generation read.
    """
    generation = control[1]
    words = lax.dynamic_slice(buffer, (generation, 0, 0), (1, batch, data_words(cfg)))[0]
    # The copy-out is complete before the re-arm: without the barrier XLA may fuse reads of the rows
    # into consumers scheduled after the re-arm, and then copies the whole buffer to keep them valid.
    words, generation, buffer, control = lax.optimization_barrier((words, generation, buffer, control))
    timed_out = jnp.any(words == jnp.uint32(SENTINEL))
    status = jnp.where(timed_out, jnp.int32(TIMEOUT), status.astype(jnp.int32))
    latent = words_to_latent(words[:, : latent_words(cfg)])
    logits = lax.bitcast_convert_type(words[:, latent_words(cfg):], jnp.float32)
    armed = jnp.full((1, batch, data_words(cfg)), SENTINEL, jnp.uint32)
    buffer = lax.dynamic_update_slice(buffer, armed, (generation, 0, 0))
    return logits, latent, status, buffer, control.at[0].set(generation)


def gemm_publish(
    x: jax.Array, packed: jax.Array, split: int, valid: int, buffer: jax.Array, control: jax.Array,
    tickets: jax.Array, cfg: FrontConfig, *, plan_block: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``front_gemm``, then rank 0's ``publish`` of its logits and latent (tp = 1): what the front
    GEMM kernel does from its epilogue. ``tickets`` (the kernel's tile counters) come back as they
    went in; ``plan_block`` names the kernel's schedule, which the reference's bits do not depend on.

    Returns ``(buffer, control, tickets, status)``.
    """
    del plan_block
    logits, latent = front_gemm(x, packed, split, valid)
    buffer, control, status = publish(buffer, control, logits, latent, 0, cfg)
    return buffer, control, tickets, status


def collect_route_plan(
    buffer: jax.Array, control: jax.Array, status: jax.Array, bias: jax.Array, batch: int,
    cfg: FrontConfig, *, with_plan: bool = False,
) -> tuple:
    """``collect``, then ``route`` over the collected logits and, ``with_plan``, the MXFP8 plan of the
    collected latent: what the routing kernel that polls the mailbox does in one launch.

    Returns ``(ids, weights, logits, latent, [(values, scales),] status, buffer, control)``.
    """
    logits, latent, status, buffer, control = collect(buffer, control, status, batch, cfg)
    ids, weights = route(logits, bias, cfg)
    planned = (mxfp8_plan(latent, cfg.plan_block),) if with_plan else ()
    return (ids, weights, logits, latent, *planned, status, buffer, control)
