"""The peer-store publish of the Lamport mailbox: one Mosaic GPU kernel per rank (SPEC.md section 7).

Rank ``r`` of ``tp`` stores its canonical words straight into generation ``g`` of EVERY rank's mailbox
(its own included) with plain 4-byte global stores through peer pointers (``plgpu.remote_ref``), and
each rank then polls only its own mailbox (``triton_mailbox.collect``). No collective, flag,
semaphore or barrier separates the ranks: the sentinel in the data says what has arrived. Never
NVLink multicast: each peer gets its own unicast stores.

Imported only on the GPU path (``mailbox.exchange(..., transport="peer")``). Mosaic GPU lowers on any
host, so the tests lower this kernel for H200s from the CPU.

How Mosaic GPU (jax 0.11.2) reaches a peer's buffer
---------------------------------------------------
``remote_ref(buffer_ref, {axis: p})`` translates the kernel's ``buffer`` operand to rank ``p``'s
``buffer`` operand of the same launch. Inside a ``shard_map`` over several devices of ONE process the
translation reads XLA's *collective metadata* (every device's operand pointers, which XLA gathers for
a kernel that uses them): no NVSHMEM, no symmetric heap, ordinary device buffers reached over
NVLink/P2P. The mailbox buffer is passed as a mutable ``jax.Ref`` (aliased in place, donated by the
caller), so each rank's operand IS its persistent mailbox and a peer's stores land in it. At tp = 1 the
only peer is the rank itself and the kernel stores through its own operand: Mosaic GPU translates a
peer reference outside a multi-device mesh with ``nvshmem_ptr``, and the XLA of jax 0.11.2 has no
NVSHMEM (on the lent H200 such a kernel failed with "UNIMPLEMENTED: NVSHMEM is not supported in XLA",
and ``--xla_gpu_experimental_enable_nvshmem`` is an unknown flag there). The tp = 1 kernel is
otherwise the same code (one destination instead of ``tp``).

Each launch skips the cross-device barrier Mosaic GPU puts before communicating kernels
(``skip_device_barrier``): the generations make it unnecessary (``mailbox``'s docstring, point 2:
with ``G >= 2`` a rank's step-``t + 1`` stores land in another generation, and its step-``t + G``
stores come after every peer re-armed step ``t``). ``exchange`` checks ``G >= 2`` for ``tp > 1``.

Kernel
------
Grid ``ceil(B * n / 128)`` blocks of one warpgroup (128 threads); thread ``i`` owns word ``i`` of the
flat ``[B, n]`` shard, ``n = L / (2 tp) + E / tp`` words per row (latent words first, then logits):
it loads the word, canonicalizes it (a bfloat16 -0 in either half of a latent word becomes +0, a
float32 -0.0 logit becomes +0.0, so no word is the sentinel), reads ``g = (control[0] + 1) mod G``,
and stores the word at row ``b`` of generation ``g`` of each of the ``tp`` mailboxes: latent word
``w`` at column ``r * L / (2 tp) + w``, logit ``e`` at ``L / 2 + r * E / tp + e``. Thread 0 of block
0 writes ``control[1] = g`` (a word no thread reads) and the status word 0 for the collect. The stores
are 4 bytes because a rank's columns need not start on a 16-byte chunk: the reader polls every word.

Bytes per call and rank: reads ``B (L / tp * 2 + E / tp * 4) = B (2L + 4E) / tp`` bytes and the
control word; writes that many bytes into each of the ``tp`` mailboxes (``(tp - 1) / tp`` of the row
over NVLink), ``B (2L + 4E)`` in all. No FLOPs. Kimi-K3 (``2L + 4E = 10752`` bytes a row): at B = 64
and tp = 8 a rank reads 86 KB and stores 688 KB, 602 KB of it to peers, about 1.3 us at the H200's
~450 GB/s of NVLink per direction.

Measured (one H200, tp = 1, CUPTI, ``bench_mailbox.py --transports``, 2026-12-03): the exchange by
peer stores (this kernel and the collect) took 2.34, 2.56 and 3.68 us at B = 1, 8 and 64, the
jax-triton publish and collect 2.34, 2.40 and 3.14 us, and the XLA all-gather path (at tp = 1 two
slice fusions, no communication) 1.71, 1.86 and 3.33 us. So the peer transport stays opt-in; at
tp > 1 it is unmeasured (no multi-GPU machine lent).

Reference: the Lamport "one-shot" all-reduce buffers of TensorRT-LLM (each rank writes its slice into
every peer's buffer through IPC pointers, readers spin on a -0.0 sentinel and reset the buffer), here
carrying an all-gather; ``mailbox.publish`` is the plain-JAX statement of the same words.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, scf

from moe_front_jax.reference import mailbox as mb

THREADS = 128
"""Threads per block: one warpgroup, one word each."""


def _i32(value: int) -> ir.Value:
    return arith.constant(ir.IntegerType.get_signless(32), value)


def _index(value: ir.Value) -> ir.Value:
    return arith.index_cast(ir.IndexType.get(), value)


def _canonical(word: ir.Value, in_latent: ir.Value) -> ir.Value:
    """The canonical word (see the module docstring); ``in_latent`` an i1."""
    low_zero = arith.cmpi(arith.CmpIPredicate.eq, arith.andi(word, _i32(0xFFFF)), _i32(0x8000))
    latent = arith.select(low_zero, arith.andi(word, _i32(-0x10000)), word)
    high = arith.shrui(latent, _i32(16))
    high_zero = arith.cmpi(arith.CmpIPredicate.eq, high, _i32(0x8000))
    latent = arith.select(high_zero, arith.andi(latent, _i32(0xFFFF)), latent)
    logit_zero = arith.cmpi(arith.CmpIPredicate.eq, word, _i32(mb.SENTINEL - (1 << 32)))
    logit = arith.select(logit_zero, _i32(0), word)
    return arith.select(in_latent, latent, logit)


def _store_words(ctx, logits, latent, control, status, *mailboxes, batch, latent_words, experts,
                 generations):
    """Per thread: one word of the shard into every mailbox view (raw Mosaic GPU code).

    ``mailboxes`` alternate (latent view, logits view) per destination rank, each
    ``[G, capacity, width]`` uint32 with the rank's columns at width offset 0.
    """
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    width = latent_words + experts
    flat = arith.addi(
        arith.muli(mgpu.utils.block_idx(), _i32(THREADS)), mgpu.utils.thread_idx()
    )
    first = arith.cmpi(arith.CmpIPredicate.eq, flat, _i32(0))
    zero = _index(_i32(0))
    generation = memref.load(control, [zero])
    generation = arith.remsi(arith.addi(generation, _i32(1)), _i32(generations))
    with mgpu.utils.when(first):
        memref.store(generation, control, [_index(_i32(1))])
        memref.store(_i32(0), status, [])
    with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.slt, flat, _i32(batch * width))):
        row = arith.divsi(flat, _i32(width))
        column = arith.remsi(flat, _i32(width))
        in_latent = arith.cmpi(arith.CmpIPredicate.slt, column, _i32(latent_words))
        g, r = _index(generation), _index(row)
        branch = scf.IfOp(in_latent, [i32], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scf.yield_([memref.load(latent, [r, _index(column)])])
        with ir.InsertionPoint(branch.else_block):
            logit = arith.subi(column, _i32(latent_words))
            scf.yield_([memref.load(logits, [r, _index(logit)])])
        word = _canonical(branch.result, in_latent)
        for latent_view, logits_view in zip(mailboxes[0::2], mailboxes[1::2]):
            with mgpu.utils.when(in_latent):
                memref.store(word, latent_view, [g, r, _index(column)])
            with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.sge, column, _i32(latent_words))):
                logit = arith.subi(column, _i32(latent_words))
                memref.store(word, logits_view, [g, r, _index(logit)])
    return None


def publish_kernel(cfg, batch: int, generations: int, axis_name: str | None):
    """The kernel for rank shards of ``cfg`` (``cfg.tp`` ranks over ``axis_name``; None for tp = 1).

    Returns ``run(logits_words, latent_words, control_ref, buffer_ref) -> status``: ``logits_words``
    ``[B, E/tp]`` and ``latent_words`` ``[B, L/(2 tp)]`` uint32 (bit views, not yet canonical),
    ``control_ref`` and ``buffer_ref`` mutable refs of the mailbox's arrays, updated in place.
    """
    tp = cfg.tp
    lw, ew = cfg.latent_per_rank // 2, cfg.experts_per_rank
    half = mb.latent_words(cfg)
    blocks = -(-batch * (lw + ew) // THREADS)
    store = functools.partial(
        _store_words, batch=batch, latent_words=lw, experts=ew, generations=generations
    )

    def body(logits_ref, latent_ref, control_ref, buffer_ref, status_ref):
        if tp == 1:
            destinations = [buffer_ref]
            rank = 0
        else:
            rank = lax.axis_index(axis_name)
            destinations = [plgpu.remote_ref(buffer_ref, {axis_name: p}) for p in range(tp)]
        views = []
        for dest in destinations:
            views.append(dest.at[:, :, pl.ds(rank * lw, lw)])
            views.append(dest.at[:, :, pl.ds(half + rank * ew, ew)])
        refs = (logits_ref, latent_ref, control_ref, status_ref, *views)
        plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(refs))(store)(*refs)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((), jnp.int32),
        grid=(blocks,),
        grid_names=("blocks",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, skip_device_barrier=True
        ),
        kernel_name="mailbox_peer_publish",
    )


def publish(buffer: jax.Array, control: jax.Array, logits: jax.Array, latent_shard: jax.Array,
            cfg, axis_name: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Store this rank's ``logits`` ``[B, E/tp]`` float32 and ``latent_shard`` ``[B, L/tp]`` bfloat16
    into rows ``[0, B)`` of the next generation of every rank's mailbox, in place.

    ``axis_name`` is the ``shard_map`` axis of the ``cfg.tp`` ranks (None for tp = 1). Returns
    ``(buffer, control, status)``, ``status`` a zeroed int32 word for ``triton_mailbox.collect``. The
    arguments are checked by ``moe_front_jax.mailbox``.
    """
    batch = logits.shape[0]
    kernel = publish_kernel(cfg, batch, buffer.shape[0], axis_name)
    logit_words = lax.bitcast_convert_type(logits, jnp.uint32)
    pairs = latent_shard.reshape(batch, cfg.latent_per_rank // 2, 2)
    latent_words = lax.bitcast_convert_type(pairs, jnp.uint32)
    control = jax.new_ref(control)
    buffer = jax.new_ref(buffer)
    status = kernel(logit_words, latent_words, control, buffer)
    return buffer[...], control[...], status
