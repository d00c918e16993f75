"""The Triton pieces of the weight-streaming GEMMs (``front_gemm``, ``shared_expert``): loads, the
vector schedule's pass over K, the split-K and stream-K handshakes, and the launch of a kernel on
any of the three schedules.

When K is split, the programs of one tile of rows hand their float32 partial tiles to the last of
them to arrive, which sums them in a fixed order (results do not depend on arrival order) and runs
the kernel's epilogue (``finish_split_k``). Stream-K (``StreamKConfig``) cuts the
``tiles x K steps`` iterations into equal runs, one per program, with the same handshake per tile
(``stream_k``). Their price: ``2 * 4 * block_rows * batch_tile`` bytes per partial tile, written and
read back through L2, and an int32 counter per tile, zeroed by XLA unless the caller keeps them. The
kernels own their loops over K and their epilogues.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_front_jax.pallas.gemm.schedule import (
    GridConfig,
    StreamKConfig,
    TritonConfig,
    VectorConfig,
)


def masked_load(ref, mask, eviction_policy=None):
    """``plgpu.load`` with zeros where ``mask`` is False; no predicate at all when ``mask`` is None
    (plain 16-byte vectors)."""
    other = None if mask is None else 0.0
    return plgpu.load(ref, mask=mask, other=other, eviction_policy=eviction_policy)


def vector_stream(x_ref, w_ref, first_rows, *, batch: int, depth: int, config: VectorConfig,
                  rows_masks) -> list[list[jax.Array]]:
    """The vector schedule's pass over all of K: for each row block starting at one of
    ``first_rows`` and each of the ``batch`` rows of ``x``, the ``[block_rows]`` float32 dot products.
    ``rows_masks``: None, or per block a ``[block_rows, 1]`` mask of the rows to read (zeros
    elsewhere).

    The K steps are unrolled: Triton pipelines only loads that feed a dot, so the loads of a loop
    would wait one by one, where straight-line code lets ptxas issue loads ahead of the
    multiply-adds (fewer of them as B grows, docs/findings.md). Each (row block, batch row) has a
    float32 ``[block_rows, block_k]`` accumulator of elementwise products, summed over its
    ``block_k`` lanes at the end (chains of ``depth / block_k`` additions per lane).
    """
    bn, bk = config.block_rows, config.block_k
    accs = [[jnp.zeros((bn, bk), jnp.float32) for _ in range(batch)] for _ in first_rows]
    masks = rows_masks or [None] * len(first_rows)
    for k in range(0, depth, bk):
        # The weight is read once per call: first out of L2, so x stays.
        ws = [masked_load(w_ref.at[pl.ds(first, bn), pl.ds(k, bk)], mask, "evict_first")
              for first, mask in zip(first_rows, masks, strict=True)]
        xs = [plgpu.load(x_ref.at[pl.ds(b, 1), pl.ds(k, bk)]).astype(jnp.float32)
              for b in range(batch)]
        for part, w in enumerate(ws):
            w = w.astype(jnp.float32)
            for b in range(batch):
                accs[part][b] = accs[part][b] + w * xs[b]
    return [[jnp.sum(acc, axis=1) for acc in part] for part in accs]


def tile_counters(tiles: int, counters: jax.Array | None = None) -> jax.Array:
    """The int32 tile counters of a split-K or stream-K call: ``counters`` (kept by the caller,
    at least ``tiles`` of them, all zero), or a fresh zeroed buffer of ``tiles``."""
    return jnp.zeros((tiles,), jnp.int32) if counters is None else counters


def split_k_workspace(config: GridConfig, tiles: int, parts: int, batch_tile: int,
                      counters: jax.Array | None = None):
    """Output shapes and the counters input of a split-K call: float32 partial tiles
    ``[split_k, tiles, parts, block_rows, batch_tile]`` and an int32 counter per tile (the counters
    are an input aliased to the last output): ``counters`` (at least ``tiles`` of them, all zero),
    or a fresh zeroed buffer. Empty when ``split_k == 1``."""
    if config.split_k == 1:
        return [], []
    return _workspace((config.split_k, tiles, parts, config.block_rows, batch_tile), tiles,
                      counters)


def _workspace(partials: tuple[int, ...], tiles: int, counters: jax.Array | None):
    """Float32 partial tiles of shape ``partials`` and the int32 tile counters, as output shapes,
    and the counters as the input aliased to the last output (``tile_counters``)."""
    counters = tile_counters(tiles, counters)
    shapes = [jax.ShapeDtypeStruct(partials, jnp.float32),
              jax.ShapeDtypeStruct(counters.shape, jnp.int32)]
    return shapes, [counters]


def finish_split_k(
    accs: Sequence[jax.Array],
    partials_ref,
    counters_ref,
    *,
    split_k: int,
    part,
    tile,
    mask,
    interpret: bool,
    epilogue: Callable[..., None],
) -> None:
    """Hand this program's float32 accumulators to the tile's last program, which runs ``epilogue``.

    Each program writes its partial tiles (``accs[j]`` to ``partials_ref[part, tile, j]``), then takes
    a ticket from the tile's counter (an acquire-release atomic after a CTA barrier); the program that
    draws ticket ``split_k - 1`` zeroes the counter (so counters kept across calls stay zero between
    them), sums the ``split_k`` partials of each accumulator in the order ``0 .. split_k - 1`` (so
    results do not depend on arrival order) and calls ``epilogue(*totals)``.
    ``split_k == 1`` calls ``epilogue(*accs)`` at once. ``mask`` (the accumulators' shape, or None)
    keeps padded batch columns out of memory.
    """
    if split_k == 1:
        epilogue(*accs)
        return
    for j, acc in enumerate(accs):
        plgpu.store(partials_ref.at[part, tile, jnp.int32(j)], acc, mask=mask)
    if not interpret:  # interpret mode runs programs one at a time (and has no barrier rule)
        # Every thread's partial stores happen before the ticket's release (a CTA barrier, then one
        # thread's acquire-release atomic: cumulativity carries the other threads' stores).
        plgpu.debug_barrier()
    ticket = plgpu.atomic_add(counters_ref, tile, jnp.int32(1))

    @pl.when(ticket == split_k - 1)
    def _():
        counters_ref[tile] = jnp.int32(0)  # every program of the tile has its ticket: re-arm
        totals = []
        for j, acc in enumerate(accs):
            total = jnp.zeros(acc.shape, jnp.float32)
            for other in range(split_k):
                # The ticket's acquire (gpu scope) makes the other programs' partials visible here;
                # no line of them can sit in this SM's L1, which only this program reads them into.
                total += plgpu.load(
                    partials_ref.at[jnp.int32(other), tile, jnp.int32(j)],
                    mask=mask,
                    other=None if mask is None else 0.0,
                )
            totals.append(total)
        epilogue(*totals)


@dataclasses.dataclass(frozen=True)
class StreamK:
    """The stream-K partition of a call: iteration ``i`` is K step ``i % steps`` of tile
    ``i // steps``; program ``p`` runs iterations ``[p * share, min((p + 1) * share, total))``, which
    touch at most ``segments`` tiles."""

    tiles: int
    steps: int
    programs: int

    @classmethod
    def of(cls, config: StreamKConfig, tiles: int, depth: int) -> StreamK:
        """The partition of ``config``'s stream-K schedule over ``tiles`` tiles of K = ``depth``."""
        return cls(tiles, depth // config.block_k, config.programs)

    @property
    def share(self) -> int:
        return -(-self.tiles * self.steps // self.programs)

    @property
    def segments(self) -> int:
        return self.share // self.steps + 2

    def workspace(self, parts: int, block_rows: int, batch_tile: int,
                  counters: jax.Array | None = None):
        """Output shapes and the counters input of a stream-K call: float32 partial tiles
        ``[programs, segments, parts, block_rows, batch_tile]`` (slot ``[program, segment]``) and an
        int32 counter per tile (an input aliased to the last output): ``counters`` (at least
        ``tiles``, all zero), or a fresh zeroed buffer."""
        return _workspace((self.programs, self.segments, parts, block_rows, batch_tile),
                          self.tiles, counters)


def stream_k(
    sk: StreamK,
    partials_ref,
    counters_ref,
    segment: Callable,
    *,
    mask,
    interpret: bool,
) -> None:
    """One stream-K program: its run of iterations, tile by tile.

    ``segment(tile, lo, hi)`` streams K steps ``[lo, hi)`` of ``tile`` and returns ``(accs,
    epilogue)``: the float32 accumulators and what to call with the tile's finished totals. Each
    segment's accumulators go to the workspace (slot ``[program, segment]``, one per accumulator)
    and the segment takes a ticket from the tile's counter (after a CTA barrier, as
    ``finish_split_k``); the tile's last contributor to arrive zeroes the counter, sums the
    contributors' partials in program order (so results do not depend on arrival order) and calls
    ``epilogue(*totals)``. ``mask`` (the accumulators' shape, or None) keeps padded batch columns
    out of memory.
    """
    steps, share = sk.steps, sk.share
    program = pl.program_id(0)
    start = program * share
    end = jnp.minimum(start + share, sk.tiles * steps)
    other = None if mask is None else 0.0
    for slot in range(sk.segments):
        tile = start // steps + slot
        lo = jnp.maximum(start, tile * steps) - tile * steps
        hi = jnp.minimum(end, (tile + 1) * steps) - tile * steps

        @pl.when((lo < hi) & (tile < sk.tiles))
        def _():
            accs, epilogue = segment(tile, lo, hi)
            for j, acc in enumerate(accs):
                plgpu.store(partials_ref.at[program, jnp.int32(slot), jnp.int32(j)], acc, mask=mask)
            if not interpret:  # the partials' stores happen before the ticket's release
                plgpu.debug_barrier()
            ticket = plgpu.atomic_add(counters_ref, tile, jnp.int32(1))
            first_program = tile * steps // share
            last_program = ((tile + 1) * steps - 1) // share

            @pl.when(ticket == last_program - first_program)
            def _():
                counters_ref[tile] = jnp.int32(0)  # every contributor has its ticket: re-arm

                def add(contributor, totals):
                    at = tile - contributor * share // steps  # the contributor's slot of this tile
                    return tuple(
                        total + plgpu.load(partials_ref.at[contributor, at, jnp.int32(j)],
                                           mask=mask, other=other)
                        for j, total in enumerate(totals)
                    )

                zeros = tuple(jnp.zeros(acc.shape, jnp.float32) for acc in accs)
                epilogue(*lax.fori_loop(first_program, last_program + 1, add, zeros))


def launch(
    kernel: Callable,
    x: jax.Array,
    w: jax.Array,
    *,
    config: TritonConfig,
    tiles: int,
    depth: int,
    parts: int,
    batch_tile: int,
    out_shape: Sequence[jax.ShapeDtypeStruct],
    in_place: Sequence[jax.Array] = (),
    counters: jax.Array | None = None,
    interpret: bool,
    name: str,
) -> list[jax.Array]:
    """``kernel`` over ``config``'s Triton schedule of ``tiles`` tiles (of ``parts`` row blocks)
    over K = ``depth``: the vector schedule's grid ``(tiles,)``, stream-K's ``(programs,)``, or
    ``(split_k, tiles)``.

    ``kernel(x_ref, w_ref, [counters_ref], *in_place_refs, *out_refs, [partials_ref,
    counters_out_ref])``: the tile counters (``counters``, or a fresh zeroed buffer) come where the
    schedule hands partials over, aliased to the last output; ``in_place`` arrays are aliased to the
    first outputs. Returns the outputs, ``out_shape``'s then the workspace's.
    """
    if isinstance(config, VectorConfig):
        # Straight-line code: no loop for Triton to pipeline.
        grid, workspace, counter_args, num_stages = (tiles,), [], [], 1
    elif isinstance(config, StreamKConfig):
        sk = StreamK.of(config, tiles, depth)
        grid = (config.programs,)
        workspace, counter_args = sk.workspace(parts, config.block_rows, batch_tile, counters)
        num_stages = config.num_stages
    elif isinstance(config, GridConfig):
        grid = (config.split_k, tiles)
        workspace, counter_args = split_k_workspace(config, tiles, parts, batch_tile, counters)
        num_stages = config.num_stages
    else:
        raise ValueError(f"config must be a GridConfig, StreamKConfig or VectorConfig, got {config!r}")
    out_shape = [*out_shape, *workspace]
    args = [x, w, *counter_args]
    aliases = {2: len(out_shape) - 1} if counter_args else {}
    aliases |= {len(args) + i: i for i in range(len(in_place))}
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=num_stages
        ),
        name=name,
    )(*args, *in_place)
