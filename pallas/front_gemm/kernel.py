"""The front GEMM as one Pallas Triton kernel (SPEC sections 3 and 5): router logits and the latent
from one pass over the packed weight.

    y = x @ packed.T (float32)     logits = y[:, :valid]     latent_shard = bf16(y[:, split:])

``front_gemm_plan`` also writes the latent's MXFP8 plan from the same epilogue (the plan kernel's
``quantize_tile``); ``front_gemm_publish`` writes logits and latent as a tp = 1 mailbox's words
(SPEC section 7) instead. No slice, cast, plan or publish kernel follows.

At decode batches the GEMM is bound by reading the weight once, so each program streams one slab of
it (``gemm.schedule``). Router tiles cover rows ``[0, valid)`` and latent tiles start at ``split``:
the padding rows are never read, a tile feeds one output, and MXFP8 blocks never straddle tiles. A
tp8 shard's 560 rows are too few tiles for 132 SMs, so K is split (the tile's last program sums
the partials and runs the epilogue, ``gemm.triton``) or cut stream-K; at B <= 8 the vector schedule
needs neither (docs/findings.md, the vector schedule). ``select`` says which schedule runs at given
shapes, and why. Triton rather than Mosaic GPU: a pipelined K loop, small-M dots, masks and atomics
are what it does well.

Cost per call (bf16 = 2 bytes; ``shard = n - split``):
  bytes = 2 (valid + shard) H             the weight, 64.2 MB at tp1 and 8.0 MB at tp8 for K3
        + 2 B H + 4 B valid + 2 B shard   x read, logits and latent written
        + B shard (1 + 1 / block)         the plan, when asked for
        + 8 B (valid + shard) split_k     partials written and read back, when K is split
  FLOPs = 2 B (valid + shard) H           about B FLOP/byte: memory-bound at decode batches
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.device import tuning_entries
from moe_front_jax.pallas.gemm import schedule
from moe_front_jax.pallas.gemm import triton as gemm_triton
from moe_front_jax.pallas.gemm.schedule import (
    FOLD_K,
    MIN_DOT,
    TRITON_CONFIGS,
    GridConfig,
    Selection,
    StreamKConfig,
    TritonConfig,
    VectorConfig,
    config_from_json,
    padded_batch,
)
from moe_front_jax.pallas.plan.kernel import quantize_tile
from moe_front_jax.reference import mailbox as mb


FrontGemmConfig = TritonConfig
"""The front GEMM's schedules (``gemm.schedule``): the grid with split-K, stream-K, or the vector
schedule (no plan epilogue). With the plan, ``block_rows`` is widened to the plan block."""


def table_key(valid: int, shard: int, hidden: int, batch: int) -> str:
    """Key of a tuning-table entry: the shard's shape and the batch rounded up to a power of two."""
    return f"valid={valid},shard={shard},hidden={hidden},batch={schedule.batch_key(batch)}"


@functools.cache
def load_table(kind: str) -> dict[tuple[str, bool], FrontGemmConfig]:
    """The tuning table of device ``kind``: ``(key, plan) -> config`` (empty where there is none).

    Each entry has the schedule of the plain GEMM (``config``) and, where the tuner timed the plan
    epilogue apart, the schedule of the GEMM with the plan (``plan_config``; else ``config``, unless
    that is a vector schedule, which has no plan epilogue).
    """
    table = {}
    for key, entry in tuning_entries(kind, "front_gemm").items():
        table[key, False] = config_from_json(entry["config"], TRITON_CONFIGS)
        plan = config_from_json(entry.get("plan_config", entry["config"]), TRITON_CONFIGS)
        # A vector schedule has no plan epilogue: the plan takes the padded batch's entry.
        if not isinstance(plan, VectorConfig):
            table[key, True] = plan
    return table


def heuristic_config(valid: int, shard: int, hidden: int, batch: int, cores: int) -> FrontGemmConfig:
    """A schedule for a device without a table (``gemm.schedule.heuristic``): 32 rows per
    program up to a batch tile of 32, 64 up to 64, then 128 (each tile re-reads ``x`` from L2,
    ``B / block_rows`` bytes per weight byte)."""
    bp = padded_batch(batch)
    block_rows = 32 if bp <= 32 else 64 if bp <= 64 else 128
    tiles = -(-valid // block_rows) + -(-shard // block_rows)
    return schedule.heuristic(tiles, hidden, block_rows, batch, cores)


def select(valid: int, shard: int, hidden: int, batch: int, plan: bool = False) -> Selection:
    """Which schedule runs the front GEMM (with the plan epilogue where ``plan``) at these shapes:
    the target device's table entry (``gemm.schedule.lookup``), else ``heuristic_config``.
    Returns ``Selection(implementation, config, reason)``."""
    config, reason = schedule.lookup(
        load_table, lambda size: (table_key(valid, shard, hidden, size), plan), batch,
        lambda cores: heuristic_config(valid, shard, hidden, batch, cores))
    return Selection(config.IMPLEMENTATION, config, reason)


def selects(x, packed, split: int, valid: int, block: int | None = None) -> Selection:
    """``select`` for the stage arguments of ``front_gemm`` (and, with ``block``,
    ``front_gemm_plan``)."""
    return select(valid, packed.shape[0] - split, x.shape[1], x.shape[0], block is not None)


def selects_publish(x, packed, split: int, valid: int, *mailbox, plan_block=None) -> Selection:
    """``select`` for ``front_gemm_publish``'s arguments: ``front_gemm_plan``'s schedule where
    ``plan_block`` is given, else ``front_gemm``'s."""
    del mailbox
    return selects(x, packed, split, valid, plan_block)


def pick_config(
    valid: int, shard: int, hidden: int, batch: int, plan: bool = False
) -> FrontGemmConfig:
    """``select(...).config``."""
    return select(valid, shard, hidden, batch, plan).config


def auto_prefers_kernel(x, packed, split, valid) -> bool:
    """``backend="auto"``'s choice for ``front_gemm(x, packed, split, valid)``: True where the target
    device's auto table measured this kernel faster than ``reference.front_gemm`` at these shapes
    (``gemm.schedule.auto_prefers``)."""
    return schedule.auto_prefers("front_gemm", x, packed,
                        lambda: table_key(valid, packed.shape[0] - split, x.shape[1], x.shape[0]))


def auto_prefers_publish(x, packed, split, valid, buffer, control, tickets, cfg, *,
                         plan_block=None) -> bool:
    """``backend="auto"``'s choice for ``front_gemm_publish``: where it prefers ``front_gemm``'s kernel
    and publishes with its schedule (``plan_block`` None: ``front_gemm_plan``, which "auto" never
    runs, is the other schedule)."""
    return plan_block is None and auto_prefers_kernel(x, packed, split, valid)


def covers(x, packed, split, valid, block=None) -> None:
    """Raise ``NotImplementedError`` where the kernel does not cover these arguments (``B > 256``, a
    hidden size not a multiple of 16, no latent rows), ``ValueError`` where they are wrong."""
    _check(x, packed, split, valid, block)


def covers_publish(x, packed, split, valid, buffer, control, tickets, cfg, *, plan_block=None) -> None:
    """``covers`` for ``front_gemm_publish``: also a mailbox of one device's rows (tp = 1) only."""
    _check(x, packed, split, valid, None)
    if cfg.tp != 1:
        raise NotImplementedError(
            f"front_gemm_publish publishes one device's rows (tp=1), got a mailbox for tp={cfg.tp}")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one call: the problem, its tiling and the tile counts."""

    batch: int
    hidden: int
    rows: int
    split: int
    valid: int
    block: int | None
    config: FrontGemmConfig
    publish: bool = False

    @property
    def shard(self) -> int:
        return self.rows - self.split

    @property
    def batch_tile(self) -> int:
        return padded_batch(self.batch)

    @property
    def tile_rows(self) -> int:
        """Rows per tile: ``block_rows``, or two one-row blocks where a vector schedule of one-row
        blocks publishes (a mailbox word holds two latent columns)."""
        bn = self.config.block_rows
        return 2 if self.publish and bn == 1 else bn

    @property
    def router_tiles(self) -> int:
        return -(-self.valid // self.tile_rows)

    @property
    def tiles(self) -> int:
        return self.router_tiles + -(-self.shard // self.tile_rows)

    @property
    def k_chunk(self) -> int:
        return self.hidden // self.config.split_k


def _tile_rows(g: Geometry, tile):
    """Tile ``tile``'s first packed row, whether it is a latent tile, and the end of its region (the
    first row past it)."""
    is_latent = tile >= g.router_tiles
    latent_tile = is_latent.astype(jnp.int32)
    # Latent tiles restart at ``split``; arithmetic rather than a scalar select, which the Triton
    # lowering mistypes.
    first_row = tile * g.tile_rows + latent_tile * (g.split - g.router_tiles * g.tile_rows)
    end_row = g.valid + latent_tile * (g.rows - g.valid)
    return first_row, is_latent, end_row


def _rows_ok(first_row, end_row, rows: int):
    """``[rows, 1]``: which of the rows from ``first_row`` lie before ``end_row``."""
    return (first_row + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) < end_row


def _accumulate(x_ref, w_ref, g: Geometry, first_row, row_ok, batch_ok, step_lo, step_hi,
                most_steps: int):
    """``[block_rows, batch_tile]`` float32: the tile's rows times ``x`` over K steps
    ``[step_lo, step_hi)`` (at most ``most_steps`` of them), in ``block_k`` steps that Triton's
    pipeliner keeps in flight; the dots' chain restarts every ``FOLD_K`` of K."""
    bn, bp, bk = g.config.block_rows, g.batch_tile, g.config.block_k
    # Masks only where a tile can run past its region or the batch past B: an unmasked load is
    # plain 16-byte vectors with no predicate.
    rows_mask = row_ok if g.valid % bn or g.shard % bn else None
    batch_mask = batch_ok if g.batch < bp else None

    fold_steps = max(1, FOLD_K // bk)
    fold = most_steps > fold_steps

    def step(i, carry):
        total, acc = carry if fold else (None, carry)
        k = pl.multiple_of((step_lo + i) * bk, bk)
        # The weight is read once per call: first out of L2, so x and the partials stay.
        w = gemm_triton.masked_load(w_ref.at[pl.ds(first_row, bn), pl.ds(k, bk)], rows_mask,
                                    "evict_first")
        xs = gemm_triton.masked_load(x_ref.at[pl.ds(0, bp), pl.ds(k, bk)], batch_mask)
        acc = acc + lax.dot_general(
            w, xs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        if fold:
            flush = (step_lo + i + 1) % fold_steps == 0
            total = total + jnp.where(flush, acc, 0.0)
            return total, jnp.where(flush, 0.0, acc)
        return acc

    zeros = jnp.zeros((bn, bp), jnp.float32)
    # A trip count, not bounds: the grid kernel's is static (a static bound for the pipeliner).
    if not fold:
        return lax.fori_loop(0, step_hi - step_lo, step, zeros)
    total, acc = lax.fori_loop(0, step_hi - step_lo, step, (zeros, zeros))
    return total + acc


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """Where the epilogue puts a finished tile: the logits and latent refs (and the plan's), or the
    mailbox's rows and the generation this call publishes (``front_gemm_publish``)."""

    logits: object = None
    latent: object = None
    values: object = None
    scales: object = None
    buffer: object = None
    control: object = None
    status: object = None
    generation: object = None

    def close(self, first_program) -> None:
        """Publishing, at the end of the grid's first program only: record the generation in
        ``control[1]`` and zero the status word, values no program of this grid reads. One program:
        every program storing them doubled the vector schedule's time at B = 1 (docs/findings.md,
        publishing from the front GEMM's epilogue). At the end: a store waits for its value, and at
        the start that is the control word's load, which the compiled code for sm_90 puts the
        weight's loads behind."""
        if self.buffer is not None:

            @pl.when(first_program)
            def _():
                self.control[1] = self.generation
                self.status[0] = jnp.int32(0)


def _outputs(g: Geometry, refs: list) -> tuple[_Outputs, object, object]:
    """Split a kernel's refs after ``x`` and ``w``: the aliased inputs (counters, mailbox), then the
    outputs in ``_call``'s order. Returns ``(outputs, partials_ref, counters_ref)``; publishing, the
    generation written is ``(control[0] + 1) mod G``, as ``reference.mailbox.publish`` has it."""
    workspace = isinstance(g.config, StreamKConfig) or (
        isinstance(g.config, GridConfig) and g.config.split_k > 1)
    refs = refs[int(workspace) + 2 * g.publish:]  # inputs aliased to outputs: use the outputs
    if g.publish:
        buffer_ref, control_ref, status_ref, *refs = refs
        generation = (control_ref[0] + 1) % buffer_ref.shape[0]
        outs = _Outputs(buffer=buffer_ref, control=control_ref, status=status_ref,
                        generation=generation)
    else:
        logits_ref, latent_ref, *refs = refs
        plan = (refs.pop(0), refs.pop(0)) if g.block is not None else (None, None)
        outs = _Outputs(logits_ref, latent_ref, *plan)
    partials_ref, counters_ref = refs if workspace else (None, None)
    return outs, partials_ref, counters_ref


def latent_words_of(latent):
    """``[..., n]`` bfloat16 (``n`` even) as canonical words ``[..., n/2]`` (Triton's split of a
    trailing pair)."""
    pairs = latent.reshape(*latent.shape[:-1], latent.shape[-1] // 2, 2)
    return mb.latent_word_pairs(*lax.unstack(pairs, axis=pairs.ndim - 1))


def _word_of(column):
    """The mailbox word holding latent column ``column`` (never negative), or the words left past it
    when given a count of columns. ``lax.div``, not ``//``: Python's floor division lowers to a
    division and sign fix-ups that hide from Triton that a tile's column is a multiple of the tile;
    compiled for sm_90, the words then went out as 32-bit stores where the plain epilogue's are
    16-byte vectors."""
    return lax.div(column, 2)


def _store_tile(y, g: Geometry, first_row, is_latent, row_ok, batch_ok, outs: _Outputs):
    """The finished tile ``y`` ``[block_rows, batch_tile]`` float32 to the logits, or to the latent
    (bfloat16) and, with the plan, its MXFP8 values and scales; with the mailbox, as canonical words
    into the rows of the generation published."""
    bn, bp = g.config.block_rows, g.batch_tile
    out_ok = row_ok.T & batch_ok  # [batch_tile, block_rows]

    @pl.when(jnp.logical_not(is_latent))
    def _():
        if g.publish:
            cells = outs.buffer.at[outs.generation, pl.ds(0, bp),
                                   pl.ds(g.shard // 2 + first_row, bn)]
            plgpu.store(cells, mb.logits_to_words(y.T), mask=out_ok)
        else:
            plgpu.store(outs.logits.at[pl.ds(0, bp), pl.ds(first_row, bn)], y.T, mask=out_ok)

    @pl.when(is_latent)
    def _():
        column = first_row - g.split
        latent = y.T.astype(jnp.bfloat16)  # [batch_tile, block_rows], as stored
        if g.publish:
            words_left = _word_of(g.shard - column)
            word_ok = batch_ok & (lax.broadcasted_iota(jnp.int32, (1, bn // 2), 1) < words_left)
            cells = outs.buffer.at[outs.generation, pl.ds(0, bp), pl.ds(_word_of(column), bn // 2)]
            plgpu.store(cells, latent_words_of(latent), mask=word_ok)
            return
        plgpu.store(outs.latent.at[pl.ds(0, bp), pl.ds(column, bn)], latent, mask=out_ok)
        if g.block is not None:
            nb = bn // g.block
            values, scales = quantize_tile(latent, g.block)  # [batch_tile, bn], [batch_tile, nb]
            plgpu.store(outs.values.at[pl.ds(0, bp), pl.ds(column, bn)], values, mask=out_ok)
            blocks_left = (g.shard - column) // g.block
            block_ok = batch_ok & (lax.broadcasted_iota(jnp.int32, (1, nb), 1) < blocks_left)
            plgpu.store(outs.scales.at[pl.ds(0, bp), pl.ds(column // g.block, nb)], scales,
                        mask=block_ok)


def _kernel(x_ref, w_ref, *refs, geometry: Geometry, interpret: bool):
    """One program of the ``split_k x tiles`` grid: chunk ``part`` of K of tile ``tile``."""
    g, cfg = geometry, geometry.config
    outs, partials_ref, counters_ref = _outputs(g, list(refs))
    part, tile = pl.program_id(0), pl.program_id(1)
    first_row, is_latent, end_row = _tile_rows(g, tile)
    row_ok = _rows_ok(first_row, end_row, cfg.block_rows)
    batch_ok = lax.broadcasted_iota(jnp.int32, (g.batch_tile, 1), 0) < g.batch
    steps = g.k_chunk // cfg.block_k
    acc = _accumulate(x_ref, w_ref, g, first_row, row_ok, batch_ok, part * steps, part * steps + steps,
                      steps)
    gemm_triton.finish_split_k(
        [acc], partials_ref, counters_ref, split_k=cfg.split_k, part=part, tile=tile,
        mask=batch_ok.T, interpret=interpret,
        epilogue=lambda y: _store_tile(y, g, first_row, is_latent, row_ok, batch_ok, outs),
    )
    outs.close((part == 0) & (tile == 0))


def _stream_k_kernel(x_ref, w_ref, *refs, geometry: Geometry, interpret: bool):
    """One stream-K program (``gemm.triton.stream_k``): its run of iterations, tile by tile, each
    tile stored by its last contributor."""
    g, cfg = geometry, geometry.config
    outs, partials_ref, counters_ref = _outputs(g, list(refs))
    sk = gemm_triton.StreamK.of(cfg, g.tiles, g.hidden)
    batch_ok = lax.broadcasted_iota(jnp.int32, (g.batch_tile, 1), 0) < g.batch

    def segment(tile, lo, hi):
        first_row, is_latent, end_row = _tile_rows(g, tile)
        row_ok = _rows_ok(first_row, end_row, cfg.block_rows)
        acc = _accumulate(x_ref, w_ref, g, first_row, row_ok, batch_ok, lo, hi,
                          min(sk.share, sk.steps))
        return [acc], lambda y: _store_tile(y, g, first_row, is_latent, row_ok, batch_ok, outs)

    gemm_triton.stream_k(sk, partials_ref, counters_ref, segment, mask=batch_ok.T,
                         interpret=interpret)
    outs.close(pl.program_id(0) == 0)


def _vector_kernel(x_ref, w_ref, *refs, geometry: Geometry, interpret: bool):
    """One program of the vector schedule: tile ``tile``'s rows over all of K on the CUDA cores
    (``gemm.triton.vector_stream``); no partial leaves the program.

    Publishing with one-row blocks, a program computes two of them (its tile is two rows), each as
    the one-row schedule does (so the same bits), and stores their pair of latent columns as one
    mailbox word."""
    del interpret
    g, bn = geometry, geometry.config.block_rows
    outs, _, _ = _outputs(g, list(refs))
    first_row, is_latent, end_row = _tile_rows(g, pl.program_id(0))
    firsts = tuple(first_row + j * bn for j in range(g.tile_rows // bn))
    masks = [_rows_ok(first, end_row, bn) for first in firsts]
    ragged = g.valid % g.tile_rows or g.shard % g.tile_rows
    blocks = gemm_triton.vector_stream(x_ref, w_ref, firsts, batch=g.batch, depth=g.hidden,
                                       config=g.config, rows_masks=masks if ragged else None)
    for b in range(g.batch):
        row = jnp.int32(b)
        ys = [block[b] for block in blocks]  # each [block_rows] float32

        @pl.when(jnp.logical_not(is_latent))
        def _():
            for first, y, mask in zip(firsts, ys, masks):
                if g.publish:
                    cells = outs.buffer.at[outs.generation, row, pl.ds(g.shard // 2 + first, bn)]
                    plgpu.store(cells, mb.logits_to_words(y), mask=mask.reshape(bn))
                else:
                    plgpu.store(outs.logits.at[row, pl.ds(first, bn)], y, mask=mask.reshape(bn))

        @pl.when(is_latent)
        def _():
            column = first_row - g.split
            latent = [y.astype(jnp.bfloat16) for y in ys]
            if not g.publish:
                plgpu.store(outs.latent.at[row, pl.ds(column, bn)], latent[0],
                            mask=masks[0].reshape(bn))
                return
            # The shard is even and its tiles start at even columns: a pair is in or out together.
            words = mb.latent_word_pairs(*latent) if len(latent) == 2 else latent_words_of(latent[0])
            n = g.tile_rows // 2
            word_ok = lax.broadcasted_iota(jnp.int32, (n,), 0) < _word_of(g.shard - column)
            plgpu.store(outs.buffer.at[outs.generation, row, pl.ds(_word_of(column), n)], words,
                        mask=word_ok)
    outs.close(pl.program_id(0) == 0)


def _check(x, packed, split, valid, block) -> None:
    schedule.check_matrices(x=x, packed=packed)
    (batch, hidden), (rows, packed_hidden) = x.shape, packed.shape
    if packed_hidden != hidden:
        raise ValueError(f"packed must have x's width {hidden} as its last dimension, got {packed.shape}")
    if batch == 0:
        raise ValueError(f"x is an empty batch (shape {x.shape}); B must be >= 1")
    for name, value in (("split", split), ("valid", valid)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be a static int, got {value!r}")
    if 0 < valid <= split == rows:
        raise NotImplementedError(
            f"packed has no latent rows (split={split} = rows): the kernel writes a latent; a front "
            "without one (latent=0) runs the reference")
    if not 0 < valid <= split < rows:
        raise ValueError(
            f"need 0 < valid <= split < rows of packed, got valid={valid}, split={split}, rows={rows}"
        )
    if block is not None:
        if not isinstance(block, int) or block < 1 or block & (block - 1) or block > 256:
            raise ValueError(f"block must be a power of two in [1, 256], got {block!r}")
        if (rows - split) % block:
            raise ValueError(
                f"the latent shard (rows - split = {rows - split}) must be a multiple of block={block}"
            )
    schedule.check_batch_covered("front_gemm", batch)
    if hidden % MIN_DOT:
        raise NotImplementedError(
            f"front_gemm needs the hidden size to be a multiple of {MIN_DOT}, got {hidden}; use "
            "backend='xla'"
        )


def _resolve(config, valid, shard, hidden, batch, block) -> FrontGemmConfig:
    config = config or pick_config(valid, shard, hidden, batch, plan=block is not None)
    if not isinstance(config, FrontGemmConfig):
        raise ValueError(f"config must be a GridConfig, StreamKConfig, VectorConfig or None, got "
                         f"{type(config).__name__}")
    config.check_divides(hidden, "hidden")
    if isinstance(config, VectorConfig) and block is not None:
        raise ValueError(f"{config} is a vector schedule, which has no plan epilogue: pass a "
                         "tensor-core schedule to front_gemm_plan")
    if isinstance(config, VectorConfig):
        config.check_batch(batch)
    if config.block_k >= FOLD_K:
        raise ValueError(f"{type(config).__name__}.block_k must be below FOLD_K={FOLD_K} (the "
                         f"accumulator's fold), got {config.block_k}")
    if block is not None and config.block_rows < block:
        # An MXFP8 block must lie in one tile: widen the tiles, keeping the schedule otherwise.
        config = dataclasses.replace(config, block_rows=max(block, MIN_DOT))
    return config


def _call(x, packed, split, valid, block, interpret, config, mailbox=None):
    """The pallas_call; ``mailbox``: None, or the ``(buffer, control, tickets)`` to publish into."""
    _check(x, packed, split, valid, block)
    (batch, hidden), rows = x.shape, packed.shape[0]
    config = _resolve(config, valid, rows - split, hidden, batch, block)
    g = Geometry(batch, hidden, rows, split, valid, block, config, publish=mailbox is not None)
    if g.publish:
        out_shape = [
            jax.ShapeDtypeStruct(mailbox[0].shape, jnp.uint32),
            jax.ShapeDtypeStruct(mailbox[1].shape, jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
        ]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((batch, valid), jnp.float32),
            jax.ShapeDtypeStruct((batch, g.shard), jnp.bfloat16),
        ]
    if block is not None:
        out_shape += [
            jax.ShapeDtypeStruct((batch, g.shard), jnp.float8_e4m3fn),
            # Bytes: Triton has no E8M0 type. XLA reinterprets them in place (no kernel).
            jax.ShapeDtypeStruct((batch, g.shard // block), jnp.uint8),
        ]
    kernel = {GridConfig: _kernel, StreamKConfig: _stream_k_kernel,
              VectorConfig: _vector_kernel}[type(config)]
    name = ("front_gemm_publish" if g.publish else "front_gemm_plan" if block is not None
            else "front_gemm")
    return gemm_triton.launch(
        functools.partial(kernel, geometry=g, interpret=interpret), x, packed, config=config,
        tiles=g.tiles, depth=hidden, parts=1, batch_tile=g.batch_tile, out_shape=out_shape,
        # The mailbox's buffer and control words, updated in place, and the tile counters that the
        # mailbox keeps from call to call.
        in_place=mailbox[:2] if g.publish else (), counters=mailbox[2] if g.publish else None,
        interpret=interpret, name=name,
    )


def front_gemm(
    x: jax.Array,
    packed: jax.Array,
    split: int,
    valid: int,
    *,
    interpret: bool = False,
    config: FrontGemmConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Router logits and the latent shard from one pass over the packed weight (SPEC section 3).

    ``x`` ``[B, H]`` bfloat16 decode rows, ``1 <= B <= 256``; ``packed`` ``[n, H]`` bfloat16: router
    rows ``[0, valid)``, padding ``[valid, split)`` (never read), latent rows ``[split, n)``;
    ``split`` and ``valid`` static ints. ``config``: None runs ``select``'s schedule;
    ``interpret``: Pallas' interpret mode (any machine). Cost: the module docstring.

    Returns ``logits`` ``[B, valid]`` float32 and ``latent_shard`` ``[B, n - split]`` bfloat16 (round
    to nearest even) of ``x @ packed.T`` accumulated in float32.

    Raises:
      ValueError: wrong shapes or dtypes, ``split``/``valid`` out of range, a config that does not
        divide ``H``.
      NotImplementedError: ``B > 256``, ``H`` not a multiple of 16, or no latent rows
        (``latent = 0``; use ``backend='xla'``).
    """
    logits, latent, *_ = _call(x, packed, split, valid, None, interpret, config)
    return logits, latent


def front_gemm_plan(
    x: jax.Array,
    packed: jax.Array,
    split: int,
    valid: int,
    block: int = 32,
    *,
    interpret: bool = False,
    config: FrontGemmConfig | None = None,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """``front_gemm`` whose epilogue also writes the latent's MXFP8 plan (SPEC section 5).

    Args:
      x, packed, split, valid, interpret, config: as for ``front_gemm``.
      block: elements per E8M0 scale, a power of two; ``n - split`` must be a multiple of it.

    Returns:
      ``(logits, latent_shard, (values, scales))``: ``front_gemm``'s outputs, ``values``
      ``[B, n - split]`` float8_e4m3fn and ``scales`` ``[B, (n - split) / block]`` float8_e8m0fnu,
      bit-equal to ``reference.mxfp8_plan(latent_shard, block)``.

    Raises:
      ValueError, NotImplementedError: as for ``front_gemm``; also a ``block`` that is not a power of
        two or does not divide the latent shard.
    """
    logits, latent, values, scales, *_ = _call(x, packed, split, valid, block, interpret, config)
    return logits, latent, (values, lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu))


def front_gemm_publish(
    x: jax.Array,
    packed: jax.Array,
    split: int,
    valid: int,
    buffer: jax.Array,
    control: jax.Array,
    tickets: jax.Array,
    cfg: FrontConfig,
    *,
    plan_block: int | None = None,
    interpret: bool = False,
    config: FrontGemmConfig | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``front_gemm`` whose epilogue publishes into a tp = 1 mailbox instead of writing the logits and
    latent: ``reference.mailbox.publish`` of ``front_gemm``'s outputs in one kernel (SPEC section 7).

    Tiles go to rows ``[0, B)`` of generation ``(control[0] + 1) mod G`` as canonical words; the
    first program records it in ``control[1]`` and zeroes the status word. ``buffer``: ``[G,
    capacity >= B, row_words]`` uint32 (donate it); ``control``: ``[2]`` int32; ``tickets``:
    ``[ticket_count(valid, n - split)]`` int32, zero, and zero again on return; ``valid`` and
    ``n - split`` are ``cfg.experts`` and ``cfg.latent``. With ``plan_block`` the schedule is
    ``front_gemm_plan``'s, so the words hold that call's bits (the plan is not written).

    Returns ``(buffer, control, tickets, status)``, ``status`` the zeroed word the collect polls.
    Raises ``front_gemm``'s errors, and ValueError for mailbox arrays that disagree with ``valid``
    and the latent, a batch over the capacity, or a ``plan_block`` that does not divide the latent.
    Cost: ``front_gemm``'s, the outputs written as words (``4 B E + 2 B L`` bytes), no second kernel.
    """
    covers_publish(x, packed, split, valid, buffer, control, tickets, cfg, plan_block=plan_block)
    shard = packed.shape[0] - split
    if (valid, shard) != (cfg.experts, cfg.latent):
        raise ValueError(
            f"the GEMM's valid={valid} router rows and {shard} latent rows must be the mailbox's "
            f"experts={cfg.experts} and latent={cfg.latent}"
        )
    expected = {"buffer": (buffer, 3, mb.row_words(cfg), jnp.uint32),
                "control": (control, 1, mb.CONTROL_WORDS, jnp.int32),
                "tickets": (tickets, 1, ticket_count(valid, shard), jnp.int32)}
    for name, (array, ndim, last, dtype) in expected.items():
        shape = tuple(getattr(array, "shape", ()))
        if len(shape) != ndim or shape[-1] != last or getattr(array, "dtype", None) != dtype:
            raise ValueError(f"{name} is {shape} {getattr(array, 'dtype', None)}, expected "
                             f"{'(G, capacity, ' if ndim == 3 else '('}{last}) {jnp.dtype(dtype)}")
    if buffer.shape[1] < x.shape[0]:
        raise ValueError(f"batch of {x.shape[0]} rows is over the mailbox capacity {buffer.shape[1]}")
    if plan_block is not None:
        if (not isinstance(plan_block, int) or isinstance(plan_block, bool) or plan_block < 1
                or plan_block & (plan_block - 1) or plan_block > 256 or shard % plan_block):
            raise ValueError(f"plan_block must be None or a power of two in [1, 256] dividing the "
                             f"latent shard ({shard}), got {plan_block!r}")
        if isinstance(config, VectorConfig):
            raise ValueError(f"plan_block asks for front_gemm_plan's schedule, a tensor-core one, "
                             f"but config is the vector schedule {config}")
        config = _resolve(config, valid, shard, x.shape[1], x.shape[0], plan_block)
    buffer, control, status, *workspace = _call(x, packed, split, valid, None, interpret, config,
                                                (buffer, control, tickets))
    tickets = workspace[-1] if workspace else tickets  # the counters, zeroed again
    return buffer, control, tickets, status.reshape(())


def ticket_count(valid: int, shard: int) -> int:
    """Tile counters ``front_gemm_publish`` takes: one per tile of the narrowest tensor-core
    schedule over a rank's rows (``MIN_DOT`` rows a tile, router and latent rows tiled apart), so
    enough for any schedule: 280 for Kimi-K3 at tp = 1."""
    return -(-valid // MIN_DOT) + -(-shard // MIN_DOT)
