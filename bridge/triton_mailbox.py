"""The Lamport mailbox on the GPU: jax-triton kernels for publish and collect (SPEC section 7).

``publish`` writes one device's logits ``[B, E]`` float32 and latent ``[B, L]`` bfloat16 into the
next generation's rows, canonicalized; ``collect`` polls those rows until no word holds the
sentinel (at most ``TRITON_COLLECT_SPIN_LIMIT`` polls, then ``TIMEOUT`` in ``status``), copies
them out and re-arms them: ``moe_front_jax.reference.mailbox.publish`` and ``.collect``, bit for bit.
The layout is that module's; why the immediate re-arm is safe, ``moe_front_jax.mailbox``'s.

Why jax-triton: the protocol needs raw pointers into a buffer updated in place across calls
(``input_output_aliases``), volatile 16-byte loads of memory another writer may change while the
kernel runs, and a spin loop bounded by a count. ``triton_call`` gives all three over the row as flat
16-byte chunks. ``jax_triton`` is imported inside the wrappers (it needs a GPU jaxlib), so the
kernels compile for sm_90 with Triton alone on a host without a GPU. With ``plan=True`` the routing
kernel polls the mailbox itself (``pallas/route_collect/kernel.py``).

Both kernels run one program per (block of ``BLOCK_CHUNKS`` 16-byte chunks, row); each thread owns
whole chunks, so every access is a 16-byte vector. No atomics: publish zeroes the status word that
collect's timed-out programs set, and each kernel writes only control words it does not read.

Cost per row, ``2L + 4E`` bytes (10752 for K3): publish reads and writes that many; collect reads the
row, writes it out and re-arms it, ``3 (2L + 4E)``. No FLOPs. At B = 64 the two move 3.4 MB: at
decode batches they cost their launches and the dependency between them, not bandwidth.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from moe_front_jax.reference import mailbox as mb

BLOCK_CHUNKS = 256
"""16-byte chunks per program, two per thread of ``NUM_WARPS`` warps (the best of 32..256 at
B = 256, equal below: docs/findings.md, Mailbox)."""
NUM_WARPS = 4
TRITON_COLLECT_SPIN_LIMIT = 1 << 16
"""Polls of a chunk block before the jax-triton collect reports ``TIMEOUT``: a never-published
collect then gives up well under a second (docs/findings.md, Mailbox). ``route_collect`` sets
its own count (``ROUTE_COLLECT_SPIN_LIMIT``) by timing its own timeout."""

_SENTINEL = tl.constexpr(mb.SENTINEL)


@triton.jit
def _canonical(words, in_latent):
    # Latent words: a bfloat16 -0 (0x8000) in either half becomes +0; logit words: -0.0 becomes +0.0.
    low_zero = (words & 0xFFFF) == 0x8000
    latent = tl.where(low_zero, words & 0xFFFF0000, words)
    latent = tl.where((latent >> 16) == 0x8000, latent & 0xFFFF, latent)
    logit = tl.where(words == _SENTINEL, words & 0, words)
    return tl.where(in_latent, latent, logit)


@triton.jit
def mailbox_publish(
    buffer_in,
    control_in,
    logits,
    latent_shard,
    buffer,
    control,
    status,
    CAPACITY: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    LATENT_WORDS: tl.constexpr,
    EXPERTS: tl.constexpr,
    GENERATIONS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Inputs 0 and 1 alias outputs 0 and 1 (jax-triton passes each pointer twice); every access goes
    # through ``buffer`` and ``control``. Every program stores the same values into ``control[1]``
    # and ``status``, words that no program of this grid reads.
    block, row = tl.program_id(0), tl.program_id(1)
    generation = (tl.load(control) + 1) % GENERATIONS
    chunk = block * BLOCK + tl.arange(0, BLOCK)
    word = chunk[:, None] * 4 + tl.arange(0, 4)[None, :]
    in_latent = word < LATENT_WORDS
    in_logits = (word >= LATENT_WORDS) & (word < LATENT_WORDS + EXPERTS)
    latent_words = latent_shard.to(tl.pointer_type(tl.uint32))
    logit_words = logits.to(tl.pointer_type(tl.uint32))
    from_latent = tl.load(latent_words + row * LATENT_WORDS + word, mask=in_latent, other=0)
    from_logits = tl.load(logit_words + row * EXPERTS + (word - LATENT_WORDS), mask=in_logits, other=0)
    words = _canonical(tl.where(in_latent, from_latent, from_logits), in_latent)
    cell = buffer + (generation * CAPACITY + row).to(tl.int64) * ROW_WORDS + word
    tl.store(cell, words, mask=in_latent | in_logits)
    tl.store(control + 1, generation)
    tl.store(status, 0)


@triton.jit
def mailbox_collect(
    buffer_in,
    control_in,
    status_in,
    buffer,
    control,
    latent,
    logits,
    status,
    CAPACITY: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    LATENT_WORDS: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SPIN: tl.constexpr,
    TIMEOUT: tl.constexpr,
):
    # Inputs 0, 1 and 2 alias outputs 0, 1 and 4; every access goes through the output pointers.
    # Every program stores the same value into ``control[0]``, a word no program of this grid reads.
    block, row = tl.program_id(0), tl.program_id(1)
    generation = tl.load(control + 1)
    chunk = block * BLOCK + tl.arange(0, BLOCK)
    word = chunk[:, None] * 4 + tl.arange(0, 4)[None, :]
    in_latent = word < LATENT_WORDS
    in_logits = (word >= LATENT_WORDS) & (word < LATENT_WORDS + EXPERTS)
    data = in_latent | in_logits
    cell = buffer + (generation * CAPACITY + row).to(tl.int64) * ROW_WORDS + word
    # Volatile: each poll re-reads memory that a writer may change while this kernel runs.
    words = tl.load(cell, mask=data, other=0, volatile=True)
    pending = tl.sum((words == _SENTINEL).to(tl.int32), axis=None)
    spins = 0
    while (pending > 0) & (spins < SPIN):
        words = tl.load(cell, mask=data, other=0, volatile=True)
        pending = tl.sum((words == _SENTINEL).to(tl.int32), axis=None)
        # Once one program has timed out the step has failed: the others stop polling at once. Every
        # thread loads the status word and the block reduces what they saw, so that all warps leave
        # the loop at the same poll (their block barriers stay paired).
        given_up = tl.max(tl.load(status + 0 * word, volatile=True), axis=None)
        spins = tl.where(given_up != 0, SPIN, spins + 1)
    if pending > 0:
        tl.store(status, TIMEOUT)
    latent_words = latent.to(tl.pointer_type(tl.uint32))
    logit_words = logits.to(tl.pointer_type(tl.uint32))
    tl.store(latent_words + row * LATENT_WORDS + word, words, mask=in_latent)
    tl.store(logit_words + row * EXPERTS + (word - LATENT_WORDS), words, mask=in_logits)
    tl.store(cell, tl.full(words.shape, _SENTINEL, tl.uint32), mask=data)
    tl.store(control, generation)


def grid(cfg, batch: int) -> tuple[int, int]:
    """(chunk blocks of a row, rows)."""
    return triton.cdiv(mb.row_words(cfg) // mb.CHUNK_WORDS, BLOCK_CHUNKS), batch


def layout(cfg) -> dict[str, int]:
    """The constexpr sizes both kernels take."""
    return dict(
        ROW_WORDS=mb.row_words(cfg),
        LATENT_WORDS=mb.latent_words(cfg),
        EXPERTS=cfg.experts,
        BLOCK=BLOCK_CHUNKS,
    )


def covers(buffer, control, logits, latent_shard, rank, cfg) -> None:
    """Raise ``NotImplementedError`` unless the publish is one device's (tp = 1): across GPUs the
    ranks publish with ``peer_mailbox``."""
    if cfg.tp != 1:
        raise NotImplementedError(
            f"the jax-triton publish writes one device's rows (tp=1), got tp={cfg.tp}: across GPUs "
            "use transport='peer'"
        )


def publish(
    buffer: jax.Array, control: jax.Array, logits: jax.Array, latent_shard: jax.Array, rank, cfg
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write ``logits`` ``[B, E]`` float32 and ``latent_shard`` ``[B, L]`` bfloat16 (tp = 1) into rows
    ``[0, B)`` of the next generation, canonicalized, in place: ``reference.mailbox.publish`` of
    rank 0 (``rank``; ``covers`` refuses tp > 1).

    Returns ``(buffer, control, status)``, ``status`` a zeroed int32 word for ``collect``. The
    arguments are checked by ``moe_front_jax.mailbox``.
    """
    outs = (_like(buffer), _like(control), jax.ShapeDtypeStruct((), jnp.int32))
    return _call(mailbox_publish, (buffer, control, logits, latent_shard), outs, {0: 0, 1: 1},
                 logits.shape[0], cfg, GENERATIONS=buffer.shape[0])


def collect(
    buffer: jax.Array, control: jax.Array, status: jax.Array, batch: int, cfg,
    spin_limit: int = TRITON_COLLECT_SPIN_LIMIT,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Poll, copy out and re-arm rows ``[0, batch)`` of the generation last published, in place:
    ``reference.mailbox.collect``.

    ``status`` is an int32 scalar holding 0 (``publish``'s); it is updated in place. Returns
    ``(logits [batch, E] float32, latent [batch, L] bfloat16, status, buffer, control)``;
    ``spin_limit`` bounds the polls of each chunk block. The arguments are checked by
    ``moe_front_jax.mailbox``.
    """
    outs = (_like(buffer), _like(control), jax.ShapeDtypeStruct((batch, cfg.latent), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, cfg.experts), jnp.float32), _like(status))
    buffer, control, latent, logits, status = _call(
        mailbox_collect, (buffer, control, status), outs, {0: 0, 1: 1, 2: 4}, batch, cfg,
        SPIN=spin_limit, TIMEOUT=mb.TIMEOUT)
    return logits, latent, status, buffer, control


def _like(array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(array.shape, array.dtype)


def _call(kernel, inputs, outs, aliases, batch: int, cfg, **constants):
    """``triton_call`` of ``kernel`` over ``grid(cfg, batch)``, the buffer (``inputs[0]``) and
    control updated in place; jax_triton is imported here, on the GPU path only."""
    import jax_triton as jt

    return jt.triton_call(
        *inputs, kernel=kernel, out_shape=outs, grid=grid(cfg, batch),
        input_output_aliases=aliases, num_warps=NUM_WARPS, name=kernel.__name__,
        CAPACITY=inputs[0].shape[1], **layout(cfg), **constants,
    )
