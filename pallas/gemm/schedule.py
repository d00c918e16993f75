"""The Triton schedules of a weight-streaming GEMM, one frozen config class each (``GridConfig``,
``StreamKConfig``, ``VectorConfig``), their JSON form, and how a kernel picks one (its tuning
table, else a heuristic) and whether ``"auto"`` runs it.

Every decode GEMM of the front streams a weight that is read once against a skinny ``x``
(``B <= 256`` rows): each program owns ``block_rows`` weight rows over a chunk of K, in ``block_k``
steps. ``moe_front_jax.pallas.gemm.triton`` runs the three schedules; a kernel module brings what
differs: its table's key and entries, its tiles and its epilogue.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple, get_args

import jax.numpy as jnp

from moe_front_jax.pallas import device

MAX_BATCH = 256
"""Largest batch one call covers: the accumulator tile is ``block_rows x`` the padded batch."""
MIN_DOT = 16
"""Smallest M, N and K of a Triton tensor-core dot; batches are padded (masked) up to it."""
VECTOR_MAX_BATCH = 8
"""Largest batch of the vector schedule: it keeps one ``[block_rows, block_k]`` float32 accumulator
per batch row and does ``2 * B`` FLOP per weight element on the CUDA cores."""
TRITON_PIPELINE_SMEM = 160 * 1024
"""The heuristic keeps a Triton program's pipeline buffers under this, leaving the rest of the
227 KiB a Hopper block may have to Triton's own layout conversions."""
FOLD_K = 2048
"""A chain of tensor-core dots longer than ``FOLD_K`` of K is folded into a second float32 sum every
``FOLD_K`` (at the same K positions whatever the partition): chained accumulation loses precision
with the chain's length, and one chain over K3's 7168 is off the logits' 1e-5 contract. Shorter
chains are not folded (the fold costs registers and the dots' asynchronous chaining); ``block_k``
stays below it (at one step per fold the fold gives no precision). docs/findings.md, stream-K and
the fold."""


class ConfigChecks:
    """What a schedule's frozen config checks on creation: each field of ``POWERS_OF_TWO`` a power
    of two at least its value, each of ``POSITIVE`` a positive int; and ``check_divides``, that its
    ``k_step`` (``K_STEP``, a product of its fields) divides the GEMM's K."""

    POWERS_OF_TWO: ClassVar[dict[str, int]] = {"block_rows": MIN_DOT, "block_k": MIN_DOT}
    POSITIVE: ClassVar[tuple[str, ...]] = ()
    K_STEP: ClassVar[tuple[str, ...]] = ("block_k",)

    def __post_init__(self):
        name = type(self).__name__
        for field, least in self.POWERS_OF_TWO.items():
            value = getattr(self, field)
            if type(value) is not int or value < least or value & (value - 1):
                raise ValueError(f"{name}.{field} must be a power of two >= {least}, got {value!r}")
        for field in self.POSITIVE:
            value = getattr(self, field)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}.{field} must be a positive int, got {value!r}")

    @property
    def k_step(self) -> int:
        """The K elements that one program's share of K is a multiple of."""
        return math.prod(getattr(self, field) for field in self.K_STEP)

    def check_divides(self, k: int, what: str) -> None:
        """Raise ValueError unless ``k_step`` divides the GEMM's K."""
        if k % self.k_step:
            raise ValueError(f"config {self} needs {what} divisible by {' * '.join(self.K_STEP)} = "
                             f"{self.k_step}, got {what}={k}")


@dataclasses.dataclass(frozen=True)
class GridConfig(ConfigChecks):
    """The grid schedule: ``split_k x tiles`` programs, each over ``block_rows`` weight rows and a
    ``K / split_k`` chunk of K in ``block_k`` steps; with ``split_k > 1`` a tile's last program
    sums the float32 partials (``gemm.triton.finish_split_k``).

    Attributes:
      block_rows, block_k: powers of two >= 16 (the tensor-core dot's M and K).
      split_k: programs per tile of rows; K must be a multiple of ``split_k * block_k``.
      num_warps, num_stages: Triton's warps per program and software-pipeline depth.
    """

    IMPLEMENTATION: ClassVar[str] = "triton_grid"
    POSITIVE: ClassVar[tuple[str, ...]] = ("split_k", "num_warps", "num_stages")
    K_STEP: ClassVar[tuple[str, ...]] = ("split_k", "block_k")
    block_rows: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class StreamKConfig(ConfigChecks):
    """Stream-K: ``programs`` programs, each over an equal run of the ``tiles x K steps``
    iterations (``gemm.triton.StreamK``), a tile's last contributor summing the partials.

    Attributes:
      block_rows, block_k: powers of two >= 16 (the tensor-core dot's M and K).
      num_warps, num_stages: Triton's warps per program and software-pipeline depth.
      programs: programs launched, >= 1.
    """

    IMPLEMENTATION: ClassVar[str] = "triton_stream_k"
    POSITIVE: ClassVar[tuple[str, ...]] = ("num_warps", "num_stages", "programs")
    block_rows: int
    block_k: int
    num_warps: int
    num_stages: int
    programs: int


@dataclasses.dataclass(frozen=True)
class VectorConfig(ConfigChecks):
    """The matrix-vector schedule for ``B <= VECTOR_MAX_BATCH``: one program per ``block_rows``
    rows over all of K, multiply-adds on the CUDA cores (``gemm.triton.vector_stream``): no split,
    no counters, no partials, no software pipeline.

    Attributes:
      block_rows: weight rows per program, a power of two (any, down to 1).
      block_k: K elements per unrolled step, a power of two >= 16.
      num_warps: Triton's warps per program.
    """

    IMPLEMENTATION: ClassVar[str] = "triton_vector"
    POWERS_OF_TWO: ClassVar[dict[str, int]] = {"block_rows": 1, "block_k": MIN_DOT}
    POSITIVE: ClassVar[tuple[str, ...]] = ("num_warps",)
    block_rows: int
    block_k: int
    num_warps: int

    def check_batch(self, batch: int) -> None:
        """Raise ValueError for a batch over ``VECTOR_MAX_BATCH`` rows."""
        if batch > VECTOR_MAX_BATCH:
            raise ValueError(f"the vector schedule {self} covers B <= {VECTOR_MAX_BATCH}, got "
                             f"B={batch}")


TritonConfig = GridConfig | StreamKConfig | VectorConfig
"""A schedule that ``gemm.triton.launch`` runs."""
TRITON_CONFIGS = get_args(TritonConfig)


def config_to_json(config) -> dict:
    """A config as a tuning table stores it: ``{"implementation": ..., **fields}``."""
    return {"implementation": config.IMPLEMENTATION, **dataclasses.asdict(config)}


def config_from_json(entry: dict, classes: tuple[type, ...]):
    """The config of a tuning-table entry (``config_to_json``'s form), one of ``classes``.

    Raises:
      ValueError: an entry without an implementation, or one that is none of ``classes``'.
    """
    fields = dict(entry)
    name = fields.pop("implementation", None)
    by_name = {cls.IMPLEMENTATION: cls for cls in classes}
    if name not in by_name:
        raise ValueError(f"a table entry's implementation must be one of {tuple(by_name)}, got "
                         f"{name!r} in {entry}")
    return by_name[name](**fields)


class Selection(NamedTuple):
    """What runs a stage for given shapes: the implementation's name, its config, and why."""

    implementation: str
    config: Any
    reason: str


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


def heuristic(tiles: int, depth: int, block_rows: int, batch: int, cores: int, *,
              parts: int = 1) -> GridConfig:
    """A grid schedule for a device without a table: ``tiles`` tiles of ``parts`` row blocks of
    ``block_rows`` rows over K = ``depth``.

    K steps of 128 columns (64 from a batch tile of 128, whose ``x`` block is twice as tall; the
    widest of these that divides K, else 16); K split, keeping at least two steps per program,
    until every one of ``cores`` SMs has a program; 8 warps from a 128 x 128 accumulator; the
    pipeline as deep as ``TRITON_PIPELINE_SMEM`` allows, 2 to 5 stages.
    """
    bp = padded_batch(batch)
    widths = (64, 32, 16) if bp >= 128 else (128, 64, 32, 16)
    block_k = next((width for width in widths if depth % width == 0), MIN_DOT)
    steps = depth // block_k
    split_k = split_for_cores(tiles, steps, cores)
    num_warps = 8 if parts * block_rows * bp >= 128 * 128 else 4
    stages = TRITON_PIPELINE_SMEM // (2 * block_k * (parts * block_rows + bp))
    num_stages = max(2, min(5, stages, steps // split_k))
    return GridConfig(block_rows, block_k, split_k, num_warps, num_stages)


def lookup(load_table: Callable[[str], dict], key: Callable[[int], Hashable], batch: int,
           fallback: Callable[[int], Any]) -> tuple[Any, str]:
    """A kernel's schedule for one call and why: the first entry found under
    ``key(batch_key(batch))`` (vector schedules are tuned per small batch), then under
    ``key(padded_batch(batch))`` (the tensor-core tile it pads to), each in ``load_table(kind)``
    for every kind of ``device.table_kinds()``; else ``fallback(cores)`` with the target's SM
    count. Returns ``(config, reason)``."""
    kinds = device.table_kinds()
    tables = [(kind, load_table(kind)) for kind in kinds]
    for size in (batch_key(batch), padded_batch(batch)):
        for kind, table in tables:
            found = table.get(key(size))
            if found is not None:
                return found, f"{kind} table, batch {size}"
    return fallback(device.core_count()), f"heuristic: no entry in the {' or '.join(kinds)} tables"


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
