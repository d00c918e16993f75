"""The schedule of a weight-streaming GEMM: ``GemmConfig``, the batch and K splits it implies, and
how a kernel picks one (its tuning table, else a heuristic) and whether ``"auto"`` runs it.

Every decode GEMM of the front streams a weight that is read once against a skinny ``x``
(``B <= 256`` rows): each program owns ``block_rows`` weight rows over a ``K / split_k`` chunk of K,
in ``block_k`` steps. Three Triton schedules (the grid with split-K, stream-K, the vector schedule;
``moe_front_jax.pallas.gemm.triton``) and the Mosaic GPU TMA schedule share this dataclass. A kernel
module brings what differs: its table's key and entries, its tiles and its epilogue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax.numpy as jnp

from moe_front_jax.pallas import device

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
      tma: (keyword only) the Mosaic GPU schedule of ``shared_expert.tma`` (the shared expert's
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

    def check_batch(self, batch: int) -> None:
        """Raise ValueError where the vector schedule is asked for more than ``VECTOR_MAX_BATCH``
        rows."""
        if self.vector and batch > VECTOR_MAX_BATCH:
            raise ValueError(
                f"the vector schedule {self} covers B <= {VECTOR_MAX_BATCH}, got B={batch}"
            )


TMA_ROWS = 64
"""Weight rows per CTA (per part) of the TMA schedule: one warpgroup's wgmma M (CTAs of 128 rows
were slower at every batch at tp1 on the H200, docs/findings.md)."""
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


SMEM_BUDGET = 160 * 1024
"""The heuristic's pipeline buffers per program stay under this (of the 227 KiB a Hopper block may
have)."""


def batch_key(batch: int) -> int:
    """The batch as the tuning tables key it: rounded up to a power of two."""
    return 1 << (batch - 1).bit_length()


def padded_batch(batch: int) -> int:
    """The Triton schedules' batch tile: ``batch`` rounded up to a power of two, at least 16 (a
    tensor-core dot's smallest N)."""
    return max(MIN_DOT, batch_key(batch))


def split_for_cores(tiles: int, steps: int, cores: int) -> int:
    """The smallest split of ``steps`` K steps (a divisor, leaving at least two steps per program)
    that gives every one of ``cores`` SMs a program over ``tiles`` tiles of rows; the finest such
    split where none does."""
    splits = [s for s in range(1, steps + 1) if steps % s == 0 and steps // s >= 2] or [1]
    return next((s for s in splits if tiles * s >= cores), splits[-1])


def heuristic(tiles: int, depth: int, block_rows: int, batch: int, cores: int, *, parts: int = 1,
              config_type: type[GemmConfig] = GemmConfig) -> GemmConfig:
    """A grid schedule for a device without a table: ``tiles`` tiles of ``parts`` row blocks of
    ``block_rows`` rows over K = ``depth``.

    K steps of 128 columns (64 from a batch tile of 128, whose ``x`` block is twice as tall; the
    widest of these that divides K, else 16); K split, keeping at least two steps per program,
    until every one of ``cores`` SMs has a program; 8 warps from a 128 x 128 accumulator; the
    pipeline as deep as ``SMEM_BUDGET`` allows, 2 to 5 stages. Returns a ``config_type``.
    """
    bp = padded_batch(batch)
    widths = (64, 32, 16) if bp >= 128 else (128, 64, 32, 16)
    block_k = next((width for width in widths if depth % width == 0), MIN_DOT)
    steps = depth // block_k
    split_k = split_for_cores(tiles, steps, cores)
    num_warps = 8 if parts * block_rows * bp >= 128 * 128 else 4
    stages = SMEM_BUDGET // (2 * block_k * (parts * block_rows + bp))
    num_stages = max(2, min(5, stages, steps // split_k))
    return config_type(block_rows, block_k, split_k, num_warps, num_stages)


def lookup(load_table: Callable[[str], dict], key: Callable[[int], Hashable], batch: int,
           fallback: Callable[[int], Any]):
    """A kernel's schedule for one call: the first entry found under ``key(batch_key(batch))`` (the
    batch's own power of two: vector schedules are tuned per small batch), then under
    ``key(padded_batch(batch))`` (the tensor-core tile it pads to), each looked up in
    ``load_table(kind)`` for every kind of ``device.table_kinds()`` (the target's own, then the one
    it borrows); else ``fallback(cores)`` with the target's SM count (a kernel's heuristic)."""
    tables = [load_table(kind) for kind in device.table_kinds()]
    for size in (batch_key(batch), padded_batch(batch)):
        for table in tables:
            found = table.get(key(size))
            if found is not None:
                return found
    return fallback(device.core_count())


def auto_prefers(stage: str, x, weight, key: Callable[[], str]) -> bool:
    """``backend="auto"``'s choice for a GEMM stage: True where the target device's auto table
    measured ``stage``'s kernel faster than its reference at table key ``key()``
    (``device.measured_faster``); False where ``x`` or ``weight`` is not a matrix or the batch is
    empty, so that the reference raises the error that names the argument."""
    if getattr(x, "ndim", 0) != 2 or getattr(weight, "ndim", 0) != 2 or x.shape[0] < 1:
        return False
    return device.measured_faster(stage, key())


def check_matrices(**arrays) -> None:
    """Raise ValueError unless every keyword's array is a 2-D bfloat16 array."""
    for name, array in arrays.items():
        shape = getattr(array, "shape", None)
        if shape is None or len(shape) != 2 or array.dtype != jnp.bfloat16:
            raise ValueError(
                f"{name} must be a 2-D bfloat16 array, got {shape} {getattr(array, 'dtype', None)}"
            )


def check_batch_covered(stage: str, batch: int) -> None:
    """Raise NotImplementedError for a batch over ``MAX_BATCH`` rows."""
    if batch > MAX_BATCH:
        raise NotImplementedError(
            f"{stage} covers B <= {MAX_BATCH} rows per call, got B={batch}; split the batch, or "
            "use backend='xla'"
        )
