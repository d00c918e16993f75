"""Collect and route in one launch: the routing kernel that polls the mailbox (SPEC 4, 5 and 7).

``route_collect(buffer, control, status, bias, batch, cfg)`` returns, for rows ``[0, batch)`` of the
generation last published, what ``reference.mailbox.collect`` then ``route.route`` return (the same
ids, weight bits, logits and latent words), re-arms the rows with the sentinel and records the
generation read in ``control[0]``; with ``with_plan``, also the MXFP8 plan of the latent from the
same registers (``plan.quantize_word_tile``): the latent is read once.

Grid. The first ``cdiv(batch, block_rows)`` programs take ``route``'s row blocks, collect only the
logits (3.5 KB a K3 row) and route them with ``route``'s functions; each other program collects (and
plans) ``LATENT_CHUNK`` latent words of one row. All poll alike (``_poll``): volatile loads until no
word holds the sentinel, at most ``ROUTE_COLLECT_SPIN_LIMIT`` times, then ``TIMEOUT`` in ``status``,
each decision reduced over the block so every warp leaves the loop at the same poll. Protocol as in
``moe_front_jax.reference.mailbox``: a program owns its words, reads ``control[1]``, writes only
``control[0]`` and re-arms after a block barrier. Interpret mode runs it with plain loads.

Why: one launch replacing collect, route and plan. It was slower than the collect and routing
kernels apart at B <= 64 (docs/findings.md, Mailbox), so ``moe_front`` runs it only with
``plan=True``.

Cost per call (``route_collect_bytes``), ``W = L / 2 + E`` data words a row (2688 for K3): 4BW read +
8BW written out and re-armed + ``route_bytes`` less its logits read, + ``B * L * (1 + 1 / block)``
plan bytes. FLOPs: ``route``'s, + about 6BL with the plan. At decode batches the launch and the
polls' round trips dominate the 12BW bytes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_front_jax.config import FrontConfig
from moe_front_jax.reference import mailbox as mb
from moe_front_jax.pallas.plan import kernel as plan
from moe_front_jax.pallas.route import kernel as rt

ROUTE_COLLECT_SPIN_LIMIT = 1 << 15
"""Polls of a row's logits (or a latent chunk) before ``route_collect`` reports ``TIMEOUT``. Each
kernel's count is set by timing its own timeout: this one so that a never-published mailbox fails
no later here than through the jax-triton collect (``TRITON_COLLECT_SPIN_LIMIT``; docs/findings.md,
Mailbox)."""


LATENT_CHUNK = 1024
"""Latent words per collecting program (``min``-ed with the row's power of two): two 16-byte accesses
per thread of a 4-warp program: the fastest of 256, 512 and 1024 at B = 256, level with them below
(docs/findings.md, Mailbox)."""


def route_collect_bytes(batch: int, cfg, with_plan: bool = False) -> int:
    """Bytes one call moves when the rows have landed (the docstring's count)."""
    words = mb.data_words(cfg)
    total = 12 * batch * words + rt.route_bytes(batch, cfg.experts, cfg.top_k) - 4 * batch * cfg.experts
    return total + (batch * cfg.latent + batch * cfg.latent // cfg.plan_block) * with_plan


def fuses_plan(cfg) -> bool:
    """Whether the kernel can write the MXFP8 plan of ``cfg``'s latent: blocks of a power of two of
    at least 2 columns (whole words); other block sizes go to the plan stage."""
    block = cfg.plan_block
    return block >= 2 and not block & (block - 1)


def _poll(cells, ok, status_ref, spin_limit: int):
    """The words at ``cells`` (volatile loads, ``ok`` masking) once none under ``ok`` holds the
    sentinel, or after ``spin_limit`` polls; returns ``(words, pending)``, ``pending`` the int32 count
    of words still holding it.

    The first load stays in flight beside whatever the caller issued before; while some word had not
    landed (a peer still writing), the loop polls and counts, carrying only the count, then the words
    are loaded again (that load masked off entirely, no access, when the first saw them all). Once
    one program has timed out the step has failed: the others stop polling at once. Every thread
    loads the status word and the block reduces what they saw, so that all warps take the same
    decision: a warp leaving the loop one poll before another would pair its later block barriers
    with the other's (the routing's reductions then race: wrong ids and an illegal-address fault)."""
    sentinel = jnp.uint32(mb.SENTINEL)

    def count(words):
        return jnp.sum(jnp.sum((words == sentinel).astype(jnp.int32), axis=1), axis=0)

    def again(carry):
        pending, spins = carry
        return (pending > 0) & (spins < spin_limit)

    def poll(carry):
        _, spins = carry
        status_cells = status_ref.at[jnp.zeros(ok.shape, jnp.int32)]
        given_up = jnp.max(jnp.max(plgpu.load(status_cells, volatile=True), axis=1), axis=0)
        words = plgpu.load(cells, mask=ok, other=0, volatile=True)
        spins = jnp.where(given_up != 0, jnp.int32(spin_limit), spins + jnp.int32(1))
        return count(words), spins

    words = plgpu.load(cells, mask=ok, other=0, volatile=True)
    first_pending = count(words)
    pending, _ = lax.while_loop(again, poll, (first_pending, jnp.int32(0)))
    words = plgpu.load(cells, mask=ok & (first_pending > 0), other=words, volatile=True)
    return words, pending


def _kernel(buffer_in, control_in, status_in, bias_ref, buffer_ref, control_ref, status_ref,
            ids_ref, weights_ref, logits_ref, latent_ref, *plan_refs, batch, cfg, lanes, chunk,
            slots, block_rows, widths, spin_limit, interpret):
    """Programs ``[0, routers)`` collect and route the logits of ``block_rows`` rows each; the
    others collect the latent, ``chunk`` words of one row each (``routers = cdiv(batch,
    block_rows)``)."""
    del buffer_in, control_in, status_in  # aliased to buffer_ref, control_ref, status_ref
    routers = pl.cdiv(batch, block_rows)
    program = pl.program_id(0)
    generation = control_ref[1]

    def finish(pending, cells, words, ok):
        """Report a timeout, re-arm the words once every thread has read them, record the
        generation read."""

        @pl.when(pending > 0)
        def _():
            status_ref[0] = jnp.int32(mb.TIMEOUT)

        if not interpret:
            plgpu.debug_barrier()
        plgpu.store(cells, jnp.full(words.shape, jnp.uint32(mb.SENTINEL)), mask=ok)
        control_ref[0] = generation

    @pl.when(program < routers)
    def _():
        bb, k, experts = block_rows, cfg.top_k, cfg.experts
        words = mb.latent_words(cfg)
        first = program * bb
        rows = first + lax.broadcasted_iota(jnp.int32, (bb, 1), 0)
        lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
        row_ok = rows < batch
        logit_ok = row_ok & (lane < experts)
        # The bias does not depend on the generation: its load is in flight beside the control word's.
        b = plgpu.load(bias_ref.at[pl.ds(0, lanes)], mask=lane[0] < experts, other=0.0)
        # Index arrays, not slices: the padded lane range runs past the row (masked).
        logit_cells = buffer_ref.at[
            generation, jnp.broadcast_to(rows, (bb, lanes)), jnp.broadcast_to(words + lane, (bb, lanes))
        ]
        slot = lax.broadcasted_iota(jnp.int32, (1, slots), 1)
        out_mask = row_ok & (slot < k)

        def gather(at_rows, at, ok):
            """The row's logit words at experts ``at`` (volatile too: a line an earlier poll cached in
            L1 may be stale)."""
            return plgpu.load(buffer_ref.at[generation, at_rows, words + at], mask=ok, other=0,
                              volatile=True)

        def keys_at(at):
            """Keys of experts ``at`` ``[bb, a, b]``, loaded again: the bits ``ordered_keys`` gave
            them."""
            ok = (at < experts) & row_ok[:, :, None]
            x = lax.bitcast_convert_type(gather(jnp.broadcast_to(rows[:, :, None], at.shape), at, ok),
                                         jnp.float32)
            bg = plgpu.load(bias_ref.at[at], mask=at < experts, other=0.0)
            return rt.ordered_keys(x, bg, at < experts, interpret)

        # The routing runs once, on the logits' last load, in straight-line code after the polling.
        logit_words, pending = _poll(logit_cells, logit_ok, status_ref, spin_limit)
        x = lax.bitcast_convert_type(logit_words, jnp.float32)
        ordered = rt.ordered_keys(x, b, lane < experts, interpret)
        if widths is None:
            ids = rt.select_ranked(ordered, lane, slot, k)
        else:
            ids = rt.select_grouped(ordered, lane, slot, k, keys_at, widths)
        # The chosen logits, gathered back from the row (unchanged until the re-arm below).
        chosen = lax.bitcast_convert_type(gather(jnp.broadcast_to(rows, (bb, slots)), ids, out_mask),
                                          jnp.float32)
        plgpu.store(ids_ref.at[pl.ds(first, bb), pl.ds(0, slots)], ids, mask=out_mask)
        plgpu.store(
            weights_ref.at[pl.ds(first, bb), pl.ds(0, slots)],
            rt.routing_weights(chosen, slot, cfg, interpret),
            mask=out_mask,
        )
        plgpu.store(logits_ref.at[pl.ds(first, bb), pl.ds(0, lanes)], x, mask=logit_ok)
        finish(pending, logit_cells, logit_words, logit_ok)

    @pl.when(program >= routers)
    def _():
        chunks = pl.cdiv(mb.latent_words(cfg), chunk)
        row, part = (program - routers) // chunks, (program - routers) % chunks
        column = part * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        ok = column < mb.latent_words(cfg)
        cells = buffer_ref.at[generation, jnp.broadcast_to(row, (1, chunk)), column]
        latent_words, pending = _poll(cells, ok, status_ref, spin_limit)
        plgpu.store(latent_ref.at[pl.ds(row, 1), pl.ds(part * chunk, chunk)], latent_words, mask=ok)
        if plan_refs:
            values_ref, scales_ref = plan_refs
            block = cfg.plan_block
            values, scales = plan.quantize_word_tile(latent_words, block)
            per_chunk = 2 * chunk // block
            scale = part * per_chunk + lax.broadcasted_iota(jnp.int32, (1, per_chunk), 1)
            plgpu.store(values_ref.at[pl.ds(row, 1), pl.ds(part * chunk, chunk)], values, mask=ok)
            plgpu.store(scales_ref.at[pl.ds(row, 1), pl.ds(part * per_chunk, per_chunk)], scales,
                        mask=scale < cfg.latent // block)
        finish(pending, cells, latent_words, ok)


def covers(buffer, control, status, bias, batch, cfg, *, with_plan: bool = False) -> None:
    """Raise ``NotImplementedError`` where the kernel does not cover this request: more than
    ``route.MAX_LANES`` experts, groups or softmax (``route.check_plain_routing``), or
    ``with_plan`` with a plan block it does not fuse."""
    rt.check_plain_routing(cfg)
    if rt.next_power_of_2(cfg.experts) > rt.MAX_LANES:
        raise NotImplementedError(
            f"route_collect holds up to {rt.MAX_LANES} experts a row, got experts={cfg.experts}")
    if with_plan and not fuses_plan(cfg):
        raise NotImplementedError(
            f"route_collect writes the plan for a plan_block that is a power of two >= 2, got "
            f"{cfg.plan_block}")


def route_collect(
    buffer: jax.Array,
    control: jax.Array,
    status: jax.Array,
    bias: jax.Array,
    batch: int,
    cfg: FrontConfig,
    *,
    with_plan: bool = False,
    spin_limit: int = ROUTE_COLLECT_SPIN_LIMIT,
    interpret: bool = False,
    config: rt.RouteConfig | None = None,
) -> tuple:
    """Poll, copy out and re-arm rows ``[0, batch)`` of the generation last published, and route them.

    ``buffer`` ``[G, capacity, row_words]`` uint32 and ``control`` ``[2]`` int32: the mailbox,
    published for this step and updated in place, as is ``status`` (int32 scalar, 0); ``bias`` ``[E]``
    float32; ``batch`` in ``[1, capacity]``; ``cfg`` the rows' layout and routing constants;
    ``with_plan`` also writes the latent's MXFP8 plan (needs ``fuses_plan(cfg)``); ``spin_limit``
    polls of a row before a timeout; ``config`` the routing schedule (None: ``route``'s).

    Returns ``(ids [batch, K] int32, weights [batch, K] bfloat16, logits [batch, E] float32, latent
    [batch, L] bfloat16, status, buffer, control)`` as ``reference.mailbox.collect`` then
    ``route.route``, the rows re-armed; with ``with_plan``, ``(values, scales)`` (``plan.plan`` of
    the latent, bit for bit) follows the latent.

    Raises ValueError for a wrong buffer, control, batch, bias or status; NotImplementedError for
    over ``route.MAX_LANES`` experts, groups, softmax, or a plan block it does not fuse.
    """
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    shape = tuple(getattr(buffer, "shape", ()))
    if (len(shape) != 3 or shape[2] != mb.row_words(cfg) or buffer.dtype != jnp.uint32
            or shape[1] < batch or tuple(getattr(control, "shape", ())) != (mb.CONTROL_WORDS,)):
        raise ValueError(f"buffer {shape} and control {getattr(control, 'shape', None)} are not a "
                         f"mailbox of {batch} or more rows laid out for {cfg}")
    rt._check(jax.ShapeDtypeStruct((batch, cfg.experts), jnp.float32), bias, cfg)
    if getattr(status, "shape", None) != () or status.dtype != jnp.int32:
        raise ValueError(f"status must be an int32 scalar, got {getattr(status, 'shape', status)}")
    covers(buffer, control, status, bias, batch, cfg, with_plan=with_plan)
    config = config or rt.pick_config(batch, cfg.experts, cfg.top_k)
    if not isinstance(config, rt.RouteConfig):
        raise ValueError(f"config must be a RouteConfig or None, got {type(config).__name__}")
    block_rows = min(config.block_rows, rt.next_power_of_2(batch))
    words = mb.latent_words(cfg)
    chunk = min(LATENT_CHUNK, rt.next_power_of_2(words))
    if with_plan:  # whole plan blocks per latent program
        chunk = max(chunk, cfg.plan_block // 2)
    kernel = functools.partial(
        _kernel,
        batch=batch,
        cfg=cfg,
        lanes=rt.next_power_of_2(cfg.experts),
        chunk=chunk,
        slots=rt.next_power_of_2(cfg.top_k),
        block_rows=block_rows,
        widths=rt.group_widths(config, cfg.experts, cfg.top_k),
        spin_limit=spin_limit,
        interpret=interpret,
    )
    plan_shapes = [
        jax.ShapeDtypeStruct((batch, words), jnp.uint16),
        jax.ShapeDtypeStruct((batch, cfg.latent // cfg.plan_block), jnp.uint8),
    ]
    buffer, control, status, ids, weights, logits, latent_words, *planned = pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct(buffer.shape, jnp.uint32),
            jax.ShapeDtypeStruct(control.shape, jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
            jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.int32),
            jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, cfg.experts), jnp.float32),
            jax.ShapeDtypeStruct((batch, words), jnp.uint32),
            *(plan_shapes if with_plan else []),
        ],
        grid=(pl.cdiv(batch, block_rows) + batch * pl.cdiv(words, chunk),),
        input_output_aliases={0: 0, 1: 1, 2: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="route_collect",
    )(buffer, control, status.reshape(1), bias)
    latent = lax.bitcast_convert_type(latent_words, jnp.bfloat16).reshape(batch, cfg.latent)
    out = (ids, weights, logits, latent)
    if with_plan:
        values, scales = planned
        values = lax.bitcast_convert_type(values, jnp.float8_e4m3fn).reshape(batch, cfg.latent)
        out += ((values, lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu)),)
    return (*out, status.reshape(()), buffer, control)
