"""The peer-store publish of the Lamport mailbox: one Mosaic GPU kernel per rank (SPEC section 7).

``publish(buffer, control, logits, latent_shard, cfg, axis_name)``: rank ``r`` of ``tp`` stores its
canonical words straight into the next generation of EVERY rank's mailbox, its own included, through
peer pointers (``plgpu.remote_ref``); each rank then polls only its own (``triton_mailbox.collect``).
No collective, flag or barrier separates the ranks: the sentinel says what has arrived. Unicast
stores, never NVLink multicast. ``moe_front_jax.reference.mailbox.publish`` states the same words in
plain JAX; the design is TensorRT-LLM's Lamport one-shot all-reduce, carrying an all-gather.

How: inside a ``shard_map`` over one process's devices, ``remote_ref`` reads XLA's collective
metadata (every device's operand pointers), no NVSHMEM; the buffer is a mutable ``jax.Ref``, aliased
and donated, so each rank's operand IS its mailbox. At tp = 1 the kernel stores through its own
operand (a peer reference outside a multi-device mesh needs NVSHMEM, which jax 0.11.2's XLA lacks).
Launches skip Mosaic GPU's cross-device barrier: with ``G >= 2`` generations a rank's next stores
land elsewhere (``moe_front_jax.mailbox``'s docstring; ``exchange`` checks ``G >= 2`` for tp > 1).

Kernel: ``ceil(B * n / 128)`` blocks of one warpgroup; thread ``i`` owns word ``i`` of the flat
``[B, n]`` shard (``n = L / (2 tp) + E / tp``, latent words then logits), canonicalizes it and stores
it at its column of generation ``(control[0] + 1) mod G`` of each of the ``tp`` mailboxes; thread 0
writes ``control[1]`` and a zero status. 4-byte stores: a rank's columns need not be chunk-aligned.

Cost per call and rank: reads ``B (2L + 4E) / tp`` bytes and writes that many into each of the ``tp``
mailboxes, ``(tp - 1) / tp`` of it over NVLink; no FLOPs. K3 at B = 64, tp = 8: 602 KB to peers.
Opt-in: at tp = 1 it was slower than XLA's all-gather path, and tp > 1 is unmeasured
(docs/findings.md, Tensor parallel).
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
