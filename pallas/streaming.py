"""Pieces shared by the weight-streaming Pallas GEMMs (``front_gemm``, ``shared_expert``).

Every decode GEMM of the front has the same schedule: a skinny ``x`` (``B <= 256`` rows) against a
weight that is read once, so each program streams one slab of the weight, ``block_rows`` rows by a
``K / split_k`` chunk of K, in ``block_k`` steps that Triton's software pipeliner keeps ``num_stages``
deep, and, when K is split, the programs of one tile of rows hand their float32 partial tiles to the
last of them to arrive, which sums them in a fixed order and runs the kernel's epilogue
(``finish_split_k``). Stream-K (``GemmConfig.programs``) cuts the ``tiles x K steps`` iterations into
equal runs, one per program, with the same handshake per tile (``stream_k``). This module holds those
handshakes, the schedule's dataclass, the batch padding, the device lookup and the tuning-table
reader; the kernels own their loops and epilogues.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from importlib import resources

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_BATCH = 256
"""Largest batch one call covers: the accumulator tile is ``block_rows x`` the padded batch."""
MIN_DOT = 16
"""Smallest M, N and K of a Triton tensor-core dot; batches are padded (masked) up to it."""


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Block shapes and schedule of one weight-streaming GEMM.

    Attributes:
      block_rows: weight rows per program (the dot's M), a power of two >= 16.
      block_k: K elements per pipelined step, a power of two >= 16.
      split_k: programs sharing one tile of rows, each over ``K / split_k`` of K; ``K`` must be a
        multiple of ``split_k * block_k``.
      num_warps, num_stages: Triton's warps per program and software-pipeline depth.
      programs: 0 for the grid of ``split_k x tiles`` programs; ``P > 0`` for stream-K: ``P``
        programs, each over an equal run of the ``tiles x K steps`` iterations (``StreamK``;
        ``split_k`` must be 1).
      vector: (keyword only) the matrix-vector schedule for batches up to ``VECTOR_MAX_BATCH``: one
        program per ``block_rows`` rows (any power of two) over all of K, multiply-adds on the CUDA
        cores instead of a tensor-core dot (``vector_stream``), so no split (``split_k`` 1), no
        counters and no partials.
      tma: (keyword only) the Mosaic GPU schedule of ``shared_expert_tma`` (the shared expert's
        kernels at ``B <= 64``): one warpgroup per 64 weight rows (``block_rows``) over a
        ``K / split_k`` chunk, the weight streamed through a ring of ``num_stages`` TMA stages of
        ``block_k`` columns into wgmma; so ``num_warps`` 4, no programs. With ``split_k > 1`` XLA
        sums the float32 partials and runs the epilogue.
      batch_m: (keyword only, with ``tma``) the TMA schedule with wgmma's operands the other way
        round: its M is the batch, padded to ``TMA_MAX_BATCH`` rows, and its N the CTA's
        ``block_rows`` weight rows, any multiple of 8 up to ``TMA_MAX_ROWS_N``, so that the tiles
        can be cut to fill the SMs (tp1: 6144 gate rows are 128 CTAs of 48, 7168 down rows 128 of
        56, where 64-row tiles make 96 and 112).
    """

    block_rows: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    programs: int = 0
    vector: bool = dataclasses.field(default=False, kw_only=True)
    tma: bool = dataclasses.field(default=False, kw_only=True)
    batch_m: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self):
        name = type(self).__name__
        for flag in ("vector", "tma", "batch_m"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{name}.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.batch_m and not (
            self.tma and isinstance(self.block_rows, int) and self.block_rows % 8 == 0
            and 8 <= self.block_rows <= TMA_MAX_ROWS_N
        ):
            raise ValueError(
                f"batch_m is a TMA schedule (tma=True) whose block_rows, wgmma's N, is a multiple "
                f"of 8 from 8 to {TMA_MAX_ROWS_N}: got {self}"
            )
        fields = (("block_k", MIN_DOT),) if self.batch_m else (
            ("block_rows", self.least_block_rows()), ("block_k", MIN_DOT))
        for field, least in fields:
            value = getattr(self, field)
            if not isinstance(value, int) or value < least or value & (value - 1):
                raise ValueError(f"{name}.{field} must be a power of two >= {least}, got {value!r}")
        for field in ("split_k", "num_warps", "num_stages"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")
        if self.vector and self.split_k != 1:
            raise ValueError(
                f"the vector schedule streams all of K per program: {name}.split_k must be 1, got "
                f"{self.split_k}"
            )
        if not isinstance(self.programs, int) or self.programs < 0:
            raise ValueError(f"{name}.programs must be an int >= 0, got {self.programs!r}")
        if self.programs and self.split_k != 1:
            raise ValueError(
                f"stream-K (programs={self.programs}) splits K itself: {name}.split_k must be 1, "
                f"got {self.split_k}"
            )
        if self.vector and self.programs:
            raise ValueError(
                f"the vector schedule streams all of K per program: {name}.programs must be 0, got "
                f"{self.programs}"
            )
        tma = (self.num_warps, self.programs, self.vector)
        if self.tma and (tma != (TMA_WARPS, 0, False) or self.num_stages < 2
                         or (self.block_rows != TMA_ROWS and not self.batch_m)):
            raise ValueError(
                f"the TMA schedule is one warpgroup per {TMA_ROWS} rows with a ring of >= 2 "
                f"stages: {name}(block_rows={TMA_ROWS}, block_k, split_k, num_warps={TMA_WARPS}, "
                f"num_stages>=2, programs=0, tma=True), got {self}"
            )

    def least_block_rows(self) -> int:
        """The fewest rows a program may own: a tensor-core dot's M, or one row (vector)."""
        return 1 if self.vector else MIN_DOT

    def check_divides(self, k: int, what: str) -> None:
        """Raise ValueError unless ``split_k * block_k`` divides the GEMM's K."""
        if k % (self.split_k * self.block_k):
            raise ValueError(
                f"config {self} needs {what} divisible by split_k * block_k = "
                f"{self.split_k * self.block_k}, got {what}={k}"
            )


TMA_ROWS = 64
"""Weight rows per CTA (per part) of the TMA schedule: one warpgroup's wgmma M. (CTAs of 128 rows
were slower at every batch at tp1: benchmarks/RESULTS.md, twelfth session.)"""
TMA_MAX_ROWS_N = 256
"""Most weight rows per CTA (per part) of the TMA schedule with ``batch_m``: wgmma's largest N."""
TMA_WARPS = 4
"""The TMA schedule's CTA: one warpgroup."""
TMA_MAX_BATCH = 64
"""Largest batch of the TMA schedule: its gate/up accumulators take ``2 * 64 * Bp / 128`` float32
registers a thread (``Bp`` the batch rounded up to 8)."""

VECTOR_MAX_BATCH = 8
"""Largest batch of the vector schedule: it keeps one ``[block_rows, block_k]`` float32 accumulator
per batch row and does ``2 * B`` FLOP per weight element on the CUDA cores."""


def padded_batch(batch: int) -> int:
    """The batch tile: ``batch`` rounded up to a power of two, at least 16 (the tables' key)."""
    return max(MIN_DOT, 1 << (batch - 1).bit_length())


def device_kind() -> str:
    """Kind of the device being compiled for: the abstract mesh's (ahead-of-time lowering), or the
    default device's."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.device_kind
    return jax.devices()[0].device_kind


TABLES_OF = {"NVIDIA H100 80GB HBM3": "NVIDIA H200"}
"""Device kinds that take another kind's schedule tables where they have no entry of their own: the
H100 SXM has the H200's 132 SMs, 227 KiB of shared memory per block and 50 MB of L2 (only the HBM
differs, 3.35 against 4.8 TB/s), and on it the H200's tables beat or tie the heuristic's schedules
at every shape measured but one (benchmarks/RESULTS.md, sixteenth session). The H100's own
shared-expert table (tp1 and tp8 at B = 1, 8, 16, 64 and tp8 B=32, tuned with the H200's schedules
timed beside: seventeenth to nineteenth sessions) comes first. Where ``backend="auto"`` runs a
kernel is each kind's own measurement (``AUTO_FILES``)."""


def table_kinds() -> tuple[str, ...]:
    """The device kinds whose schedule tables the target device consults, in order: its own, then
    the kind it borrows from (``TABLES_OF``) for the keys its own tables lack."""
    kind = device_kind()
    return (kind, TABLES_OF[kind]) if kind in TABLES_OF else (kind,)


def core_count(default: int = 132) -> int:
    """Streaming multiprocessors of the target device (the abstract mesh's when lowering ahead of
    time), ``default`` where unknown."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    cores = getattr(abstract, "num_cores", None) if abstract is not None else None
    if not cores:
        cores = getattr(jax.devices()[0], "core_count", None)
    return cores or default


@functools.cache
def table_entries(file_name: str) -> dict[str, dict]:
    """The ``entries`` of tuning table ``pallas/tuning/<file_name>`` (installed as package data)."""
    text = resources.files("moe_front_jax.pallas").joinpath("tuning", file_name).read_text()
    return json.loads(text)["entries"]


AUTO_FILES = {"NVIDIA H200": "h200_auto.json", "NVIDIA H100 80GB HBM3": "h100_auto.json"}
"""Per device kind, under ``pallas/tuning/``: where ``backend="auto"`` runs a GEMM kernel rather than
the XLA reference (``benchmarks/auto_table.py`` makes it from benchmark runs)."""


def measured_faster(stage: str, key: str) -> bool:
    """Whether the target device's auto table has ``stage``'s kernel faster than the XLA reference at
    tuning-table key ``key``; False for a device, stage or key it does not list."""
    name = AUTO_FILES.get(device_kind())
    if name is None:
        return False
    return table_entries(name).get(stage, {}).get(key, {}).get("kernel", False)


def split_for_cores(tiles: int, steps: int, cores: int) -> int:
    """The smallest split of ``steps`` K steps (a divisor, leaving at least two steps per program)
    that gives every one of ``cores`` SMs a program over ``tiles`` tiles of rows; the finest such
    split where none does."""
    splits = [s for s in range(1, steps + 1) if steps % s == 0 and steps // s >= 2] or [1]
    return next((s for s in splits if tiles * s >= cores), splits[-1])


def masked_load(ref, mask, eviction_policy=None):
    """``plgpu.load`` with zeros where ``mask`` is False; no predicate at all when ``mask`` is None
    (plain 16-byte vectors)."""
    other = None if mask is None else 0.0
    return plgpu.load(ref, mask=mask, other=other, eviction_policy=eviction_policy)


def vector_stream(x_ref, w_ref, first_rows, *, batch: int, depth: int, config: GemmConfig,
                  rows_masks) -> list[list[jax.Array]]:
    """The vector schedule's pass over all of K: for each row block starting at one of
    ``first_rows`` and each of the ``batch`` rows of ``x``, the ``[block_rows]`` float32 dot products.
    ``rows_masks``: None, or per block a ``[block_rows, 1]`` mask of the rows to read (zeros
    elsewhere).

    The K steps are unrolled (no loop): Triton pipelines only loads that feed a dot, so the loads of
    a loop would wait one by one, where straight-line code lets the compiler issue a program's loads
    ahead of its multiplies. How far ahead is ptxas's choice: compiled for sm_90, a B=1 program of
    two rows issues 12 of its 28 weight loads before its first multiply-add, a B=4 program of one
    row 3 of its 14 (6 with every weight load placed first in the source), a likely reason why
    the schedule slows down with B (not profiled). Each (row block, batch row) has a float32
    ``[block_rows, block_k]`` accumulator of elementwise products, summed over its ``block_k``
    lanes at the end (chains of ``depth / block_k`` additions per lane).
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


def split_k_workspace(config: GemmConfig, tiles: int, parts: int, batch_tile: int,
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
