"""The shared expert as two Pallas kernels: gate/up with situ in its epilogue, then down (SPEC 6).

``shared_expert(x, gate_up, down, cfg, out_dtype)`` computes, on one rank's slice (``S_r = S / tp``),

    gate, up = bf16(x @ gate_up[:S_r].T), bf16(x @ gate_up[S_r:].T)   float32 accumulation
    hidden   = situ(gate, up)                                          bf16 [B, S_r]   (kernel 1)
    shared   = hidden @ down.T                                         float32 accumulation, [B, H]
                                                                       out_dtype        (kernel 2)

The float32 gate and up never leave the first kernel: its epilogue rounds them to bfloat16, applies
``reference.situ`` (the same float32 arithmetic) and writes only ``hidden``, ``2 * B * S_r`` bytes.
Under tp the result is this rank's partial sum (``out_dtype=float32``), reduced by the caller
(``parallel.reduce_shared``).

Schedule. Both GEMMs are bound by reading their weight, so each is ``streaming``'s schedule: every
program streams one slab of the weight, ``block_rows`` rows by a ``K / split_k`` chunk of K, in
``block_k`` steps that Triton's software pipeliner keeps ``num_stages`` deep, and when K is split the
tile's last program to arrive sums the float32 partials in a fixed order and runs the epilogue
(``gemm.triton.finish_split_k``). Situ needs gate row ``j`` and up row ``j`` in the same program: each
gate/up program loads TWO row blocks per K step, ``gate_up[r : r + block_rows]`` and
``gate_up[S_r + r : S_r + r + block_rows]``, into two accumulators (two contiguous slabs, as cheap to
stream as one of twice the height), so the weight keeps its checkpoint layout (gate rows, then up
rows; ``params.rank_slices``) and nothing is repacked. A gate/up tile is ``2 * block_rows`` weight
rows. At tp1 the tiles alone fill the GPU (6144 / 32 = 192 tiles); at tp8 a rank has 768 gate and
768 up rows, 48 tiles of 16, too few for 132 SMs, so K (7168) is split, e.g. 4 ways: 192 programs of
32 rows x 1792. The down GEMM has ``N = H = 7168`` rows and ``K = S_r`` (6144 at tp1, only 768 at
tp8): its row tiles alone give 224 programs of 32 rows, so it rarely needs a split. Two launches per
call (plus, when a kernel splits K or runs stream-K, XLA's zeroing of its int32 counters), as XLA's
own fusion needs.

Stream-K (``GemmConfig(programs=P)``, ``gemm.triton.stream_k``): the ``tiles x K steps`` iterations
cut into ``P`` equal runs, one per program, each tile finished by its last contributor, as the
front GEMM's. At tp1 B=64 the table's grid (96 gate/up tiles of 64 + 64 rows, K split in two) gave
192 programs of 196 KiB of pipeline buffers each, one per SM: 1.45 waves, the last 45% full, and
the weight read at 3.1 TB/s (Nsight Compute, benchmarks/RESULTS.md, tenth session); ``P`` programs,
one per SM, end together: 132 programs of 64 + 64 rows took that gate/up from 58.2 to 54.1 us. At
tp1 B=16 and 32, at tp8, and for the down kernel, the grid (or the heuristic) stayed faster.

Vector schedule (``GemmConfig(vector=True)``, ``B <= 8``; ``gemm.triton.vector_stream``): either kernel
as one program per ``block_rows`` rows (1 to 16; gate/up: as many gate and up rows) over all of K,
multiply-adds on the CUDA cores, no split, no counters; the same epilogues. At tp8 a gate/up program
of one gate and one up row gives 768 programs without splitting K.

TMA schedule (``GemmConfig(64, block_k, split_k, 4, stages, tma=True)``, ``B <= 64``;
``shared_expert_tma``): either kernel in Mosaic GPU, one warpgroup per 64 weight rows over a
``K / split_k`` chunk, the weight streamed through a ring of TMA stages into wgmma; where K is split
or the output is float32, XLA sums the kernel's float32 partials and runs the epilogue. A gate/up
that splits K (without ``batch_m``) leaves ``hidden`` transposed, ``[S_r, Bp]``, as its partials
lie, and a grid or stream-K down reads it so (``down_proj_t``, ``Geometry.x_t``): one XLA fusion between the two
kernels instead of a reduction and a transpose. With ``batch_m=True`` the batch is wgmma's M and
the CTA's weight rows its N, any multiple of 8: tp1's 6144 gate rows in 128 CTAs of 48 and 7168
down rows in 128 of 56, where 64-row CTAs leave 36 and 20 of the 132 SMs idle; the H100 runs it at
tp1 B=64 (92.3-95.0 us per call against 95.0-98.1 for 64-row CTAs, three runs), while on the H200
it tied at B=64 and lost below (eighteenth session), so the H200's table keeps 64-row CTAs.

Backend: Pallas' Triton lowering (deprecated in jax 0.11 but working) for the grid, stream-K and
vector schedules, for the reasons of ``front_gemm``: a pipelined K loop, small-M tensor-core dots,
masks and global atomics are what Triton does well; tanh lowers to libdevice and the sigmoid to
``1 / (1 + exp(-g))``. Mosaic GPU for the TMA schedule, where a whole-K row tile needs no split-K
handshake and the copy engine keeps more of the weight in flight than Triton's loads do.

Cost per call (bf16 = 2 bytes; ``s1``, ``s2`` the two kernels' split_k, their partials 0 when 1):
  bytes  = 2 * 2 * S_r * H            gate_up read: 176 MB at tp1, 22 MB at tp8 for K3
         + 2 * H * S_r                down read: 88 MB at tp1, 11 MB at tp8
                                      (the weights: 264.2 MB at tp1, 33.0 MB at tp8: the bound)
         + 2 * B * H                  x (read from L2 by every tile)
         + 2 * 2 * B * S_r            hidden written, then read by every down tile from L2
         + B * H * size(out_dtype)    shared written
         + 8 * B * 2 * S_r * s1 + 8 * B * H * s2   partial tiles written and read back
                                      (stream-K: 8 * B_tile * block_rows * parts per tile segment)
  FLOPs  = 2 * B * 3 * S_r * H        (+ about 20 FLOPs and 3 transcendentals per hidden element)
so the arithmetic intensity is about B FLOP/byte: memory-bound for decode batches; the floor on an
H200 is the weight bytes over the HBM read bandwidth (56.8 us at tp1, 7.1 us at tp8 at 4.65 TB/s).

Measured on the H200 (2026-12-04, thirteenth session's run 11, tuned table, CUPTI, weights rotated;
benchmarks/RESULTS.md): tp1 B=1/8/16/64 64.7/63.9/65.7/68.8 us (4.09/4.14/4.02/3.84 TB/s) on the
TMA schedule against XLA's 72.9/72.6/72.4/86.6 (the Triton schedules' best took 68.0/69.1/69.4/83.8
in the eleventh session); tp8 B=1/8/16/64 12.6/13.5/13.7/16.0 us against 14.6/14.8/16.2/21.1 (the
twelfth session's, with ``hidden`` transposed to ``[B, S_r]`` between the kernels: 12.4/14.5/14.9/
17.9). The table runs the TMA schedule for both kernels at tp1 (B = 1-64), the vector gate/up at tp8
B=1-2, the TMA gate/up (K split 8 ways) at tp8 B=4-64 and the tensor-core down at tp8. ``"auto"``
runs these kernels where they measured faster in every run (``auto_prefers_kernel``): at tp1 and tp8
for every B <= 64. Both GEMMs in one launch was slower at every shape measured: in Triton with a
ticket per program's work (the fifth and eleventh sessions), and in Mosaic GPU with the down rows
resident in shared memory and semaphore handshakes (thirteenth session, branch ``fused-tma``:
15.5-18.8 us at tp8, its handshakes' chain of global round trips about 6 us): the two kernels stay.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_front_jax import reference
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.shared_expert import tma as shared_expert_tma
from moe_front_jax.pallas.device import core_count, measured_faster, table_kinds, tuning_entries
from moe_front_jax.pallas.gemm.schedule import (
    MAX_BATCH,
    MIN_DOT,
    VECTOR_MAX_BATCH,
    GemmConfig,
    padded_batch,
    split_for_cores,
)
from moe_front_jax.pallas.gemm.triton import (
    StreamK,
    finish_split_k,
    masked_load,
    split_k_workspace,
    stream_k,
    vector_stream,
)

SMEM_BUDGET = 160 * 1024
"""The heuristic's pipeline buffers per program stay under this."""


@dataclasses.dataclass(frozen=True)
class SharedExpertConfig:
    """Schedules of the two kernels.

    Attributes:
      gate_up: the gate/up GEMM's (``block_rows`` gate rows and as many up rows per program; K = H).
      down: the down GEMM's (``block_rows`` of the H output rows per program; K = S_r).
    """

    gate_up: GemmConfig
    down: GemmConfig

    def __post_init__(self):
        for name in ("gate_up", "down"):
            if not isinstance(getattr(self, name), GemmConfig):
                raise ValueError(
                    f"SharedExpertConfig.{name} must be a GemmConfig, got {getattr(self, name)!r}"
                )

    @classmethod
    def from_json(cls, entry: dict) -> SharedExpertConfig:
        return cls(GemmConfig(**entry["gate_up"]), GemmConfig(**entry["down"]))


def table_key(shared_per_rank: int, hidden: int, batch: int) -> str:
    """Key of a tuning-table entry: the rank's slice and the batch rounded up to a power of two."""
    return f"shared={shared_per_rank},hidden={hidden},batch={1 << (batch - 1).bit_length()}"


def load_table(kind: str) -> dict[str, SharedExpertConfig]:
    """The tuning table of device ``kind``: ``key -> config`` (empty where there is none)."""
    return {key: SharedExpertConfig.from_json(entry)
            for key, entry in tuning_entries(kind, "shared_expert").items()}


def _block_k(k: int, bp: int) -> int:
    return next((b for b in ((64, 32, 16) if bp >= 128 else (128, 64, 32, 16)) if k % b == 0), MIN_DOT)


def _schedule(tiles: int, k: int, block_rows: int, parts: int, bp: int, cores: int) -> GemmConfig:
    block_k = _block_k(k, bp)
    steps = k // block_k
    split_k = split_for_cores(tiles, steps, cores)
    num_warps = 8 if parts * block_rows * bp >= 128 * 128 else 4
    depth = SMEM_BUDGET // (2 * block_k * (parts * block_rows + bp))
    num_stages = max(2, min(5, depth, steps // split_k))
    return GemmConfig(block_rows, block_k, split_k, num_warps, num_stages)


def heuristic_config(shared_per_rank: int, hidden: int, batch: int, cores: int) -> SharedExpertConfig:
    """Schedules for a device without a table.

    Gate/up programs take 16 gate + 16 up rows up to a batch tile of 32, twice that above (each tile
    re-reads ``x`` from L2); down programs 32 rows, 64 above a batch tile of 64. K is split, keeping at
    least two K steps per program, until every one of ``cores`` SMs has a program; the pipeline is as
    deep as 160 KiB of shared memory allows (up to 5).
    """
    bp = padded_batch(batch)
    gate_rows = 16 if bp <= 32 else 32
    down_rows = 32 if bp <= 64 else 64
    return SharedExpertConfig(
        _schedule(-(-shared_per_rank // gate_rows), hidden, gate_rows, 2, bp, cores),
        _schedule(-(-hidden // down_rows), shared_per_rank, down_rows, 1, bp, cores),
    )


def pick_config(shared_per_rank: int, hidden: int, batch: int) -> SharedExpertConfig:
    """The table's entry for this shape on the target device (its own table's, else the one it
    borrows, ``device.TABLES_OF``), else ``heuristic_config``."""
    tables = [load_table(kind) for kind in table_kinds()]
    # The batch's own power of two (vector schedules are tuned per small batch), then the
    # tensor-core batch tile it pads to; each in the device's own table, then the borrowed one.
    for size in (batch, padded_batch(batch)):
        for table in tables:
            found = table.get(table_key(shared_per_rank, hidden, size))
            if found is not None:
                return found
    return heuristic_config(shared_per_rank, hidden, batch, core_count())


def auto_prefers_kernel(x, gate_up, down, cfg, out_dtype=jnp.bfloat16) -> bool:
    """``backend="auto"``'s choice for ``shared_expert(x, gate_up, down, cfg, out_dtype)``: True
    where the target device's auto table measured these kernels faster than
    ``reference.shared_expert`` at these shapes (``device.measured_faster``; the batch takes its
    power of two's entry). The table's runs are in the dtype ``moe_front`` asks for (bfloat16 at tp1,
    the float32 partial under tp)."""
    del gate_up, cfg, out_dtype
    if getattr(x, "ndim", 0) != 2 or getattr(down, "ndim", 0) != 2 or x.shape[0] < 1:
        return False  # the reference raises the error that names the argument
    return measured_faster("shared_expert", table_key(down.shape[1], x.shape[1], x.shape[0]))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one GEMM of a call: ``rows`` output rows (per part) over K = ``depth``;
    ``x_t``: ``x`` comes transposed, ``[depth, batch_tile]``, its columns past ``batch`` zero."""

    batch: int
    depth: int
    rows: int
    config: GemmConfig
    x_t: bool = False

    @property
    def batch_tile(self) -> int:
        return padded_batch(self.batch)

    @property
    def tiles(self) -> int:
        return -(-self.rows // self.config.block_rows)

    @property
    def k_chunk(self) -> int:
        return self.depth // self.config.split_k


def _stream(x_ref, w_ref, first_rows, g: Geometry, rows_mask, batch_mask, step_lo, steps):
    """The K loop of one program: ``[block_rows, batch_tile]`` float32 products of the weight rows
    starting at each of ``first_rows`` with ``x``, over ``steps`` K steps from step ``step_lo``."""
    bn, bp, bk = g.config.block_rows, g.batch_tile, g.config.block_k

    x_axis = 0 if g.x_t else 1  # x's K axis

    def step(i, accs):
        k = pl.multiple_of((step_lo + i) * bk, bk)
        if g.x_t:
            xs = plgpu.load(x_ref.at[pl.ds(k, bk), :])
        else:
            xs = masked_load(x_ref.at[pl.ds(0, bp), pl.ds(k, bk)], batch_mask)
        out = []
        for acc, first in zip(accs, first_rows):
            # The weight is read once per call: first out of L2, so x and the partials stay.
            w = masked_load(w_ref.at[pl.ds(first, bn), pl.ds(k, bk)], rows_mask, "evict_first")
            out.append(acc + lax.dot_general(
                w, xs, (((1,), (x_axis,)), ((), ())), preferred_element_type=jnp.float32
            ))
        return tuple(out)

    zeros = tuple(jnp.zeros((bn, bp), jnp.float32) for _ in first_rows)
    return lax.fori_loop(0, steps, step, zeros)


def _tile(g: Geometry, situ, tile):
    """Tile ``tile``'s first row, its ``[block_rows, 1]`` rows in range, the first rows of its row
    blocks (gate/up: the gate rows and the up rows ``g.rows`` below), and the loads' masks: only
    where a tile can run past the rows or the batch past B (an unmasked load is plain 16-byte
    vectors with no predicate)."""
    bn, bp = g.config.block_rows, g.batch_tile
    first_row = tile * bn
    row_ok = (first_row + lax.broadcasted_iota(jnp.int32, (bn, 1), 0)) < g.rows
    batch_ok = lax.broadcasted_iota(jnp.int32, (bp, 1), 0) < g.batch
    rows_mask = row_ok if g.rows % bn else None
    batch_mask = batch_ok if g.batch < bp and not g.x_t else None
    first_rows = (first_row, first_row + g.rows) if situ else (first_row,)
    return first_row, row_ok, batch_ok, first_rows, rows_mask, batch_mask


def _store_tile(out_ref, ys, g: Geometry, first_row, row_ok, batch_ok, situ, out_dtype):
    """The finished tile (``ys``: each ``[block_rows, batch_tile]`` float32): situ of its gate and
    up rounded to bfloat16 (gate/up kernel), or the product in ``out_dtype`` (down kernel)."""
    bn, bp = g.config.block_rows, g.batch_tile
    out_ok = row_ok.T & batch_ok  # [batch_tile, block_rows]
    if situ:
        gate, up = (y.T.astype(jnp.bfloat16) for y in ys)
        out = reference.situ(gate, up, *situ)
    else:
        out = ys[0].T.astype(out_dtype)
    plgpu.store(out_ref.at[pl.ds(0, bp), pl.ds(first_row, bn)], out, mask=out_ok)


def _kernel(x_ref, w_ref, *refs, geometry: Geometry, situ, out_dtype, interpret: bool):
    """One program of either GEMM on the grid: ``situ`` = (beta, linear_beta) makes it the gate/up
    kernel (two row blocks, ``geometry.rows`` apart, and the situ epilogue), None the down kernel."""
    g, cfg = geometry, geometry.config
    split_k = cfg.split_k
    if split_k > 1:
        refs = refs[1:]  # the counters' input ref; its aliased output ref comes last
    out_ref, *refs = refs
    partials_ref, counters_ref = refs if split_k > 1 else (None, None)
    tile = pl.program_id(1)
    first_row, row_ok, batch_ok, first_rows, rows_mask, batch_mask = _tile(g, situ, tile)
    steps = g.k_chunk // cfg.block_k
    accs = _stream(x_ref, w_ref, first_rows, g, rows_mask, batch_mask, pl.program_id(0) * steps,
                   steps)
    finish_split_k(
        accs, partials_ref, counters_ref, split_k=split_k, part=pl.program_id(0), tile=tile,
        mask=None if batch_mask is None else batch_mask.T, interpret=interpret,
        epilogue=lambda *ys: _store_tile(out_ref, ys, g, first_row, row_ok, batch_ok, situ,
                                         out_dtype),
    )


def _stream_k_kernel(x_ref, w_ref, counters_in_ref, out_ref, partials_ref, counters_ref, *,
                     geometry: Geometry, situ, out_dtype, interpret: bool):
    """One stream-K program of either GEMM (``gemm.triton.stream_k``), as ``_kernel``'s tiles."""
    del counters_in_ref  # aliased to counters_ref
    g = geometry
    sk = StreamK(g.tiles, g.depth // g.config.block_k, g.config.programs)

    def segment(tile, lo, hi):
        first_row, row_ok, batch_ok, first_rows, rows_mask, batch_mask = _tile(g, situ, tile)
        accs = _stream(x_ref, w_ref, first_rows, g, rows_mask, batch_mask, lo, hi - lo)
        return accs, lambda *ys: _store_tile(out_ref, ys, g, first_row, row_ok, batch_ok, situ,
                                             out_dtype)

    batch_ok = lax.broadcasted_iota(jnp.int32, (1, g.batch_tile), 1) < g.batch
    stream_k(sk, partials_ref, counters_ref, segment,
             mask=batch_ok if g.batch < g.batch_tile else None, interpret=interpret)


def _vector_kernel(x_ref, w_ref, out_ref, *, geometry: Geometry, situ, out_dtype, interpret: bool):
    """One program of either GEMM on the vector schedule (``gemm.triton.vector_stream``): one tile of
    rows (and, for gate/up, the up rows ``geometry.rows`` below) over all of K, then the epilogue."""
    del interpret
    g, bn = geometry, geometry.config.block_rows
    first_row = pl.program_id(0) * bn
    row_ok = (first_row + lax.broadcasted_iota(jnp.int32, (bn,), 0)) < g.rows
    ragged = g.rows % bn != 0
    first_rows = (first_row, first_row + g.rows) if situ else (first_row,)
    parts = vector_stream(x_ref, w_ref, first_rows, batch=g.batch, depth=g.depth, config=g.config,
                          rows_masks=[row_ok[:, None]] * len(first_rows) if ragged else None)
    for b in range(g.batch):  # each part's [block_rows] float32 sums of batch row b
        if situ:
            gate, up = (part[b].astype(jnp.bfloat16) for part in parts)
            out = reference.situ(gate, up, *situ)
        else:
            out = parts[0][b].astype(out_dtype)
        plgpu.store(out_ref.at[jnp.int32(b), pl.ds(first_row, bn)], out,
                    mask=row_ok if ragged else None)


def _gemm(x, w, rows, out_dtype, config, situ, interpret, name, batch_t=None):
    """Either kernel on ``config``'s schedule; ``batch_t``: ``x`` is given transposed (``[K, batch
    tile]``, columns past ``batch_t`` zero; grid and stream-K schedules)."""
    x_t = batch_t is not None
    batch, depth = (batch_t, x.shape[0]) if x_t else x.shape
    if x_t and (config.tma or config.vector):
        raise ValueError(f"a transposed hidden needs a grid or stream-K schedule, got {config}")
    if config.tma:
        if situ:
            return shared_expert_tma.gate_up_situ(x, w, *situ, config=config, interpret=interpret)
        return shared_expert_tma.down_proj(x, w, out_dtype, config=config, interpret=interpret)
    config.check_divides(depth, "K")
    g = Geometry(batch, depth, rows, config, x_t)
    if x_t and x.shape[1] != g.batch_tile:
        raise ValueError(f"hidden.T must have the batch tile's {g.batch_tile} columns, got {x.shape}")
    if config.vector:
        if batch > VECTOR_MAX_BATCH:
            raise ValueError(f"the vector schedule {config} covers B <= {VECTOR_MAX_BATCH}, got "
                             f"B={batch}")
        return pl.pallas_call(
            functools.partial(
                _vector_kernel, geometry=g, situ=situ, out_dtype=out_dtype, interpret=interpret
            ),
            out_shape=jax.ShapeDtypeStruct((batch, rows), out_dtype),
            grid=(g.tiles,),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(
                num_warps=config.num_warps, num_stages=config.num_stages
            ),
            name=name,
        )(x, w)
    parts = 2 if situ else 1
    if config.programs:
        sk = StreamK(g.tiles, depth // config.block_k, config.programs)
        workspace, counters = sk.workspace(parts, config.block_rows, g.batch_tile)
        kernel, grid = _stream_k_kernel, (config.programs,)
    else:
        workspace, counters = split_k_workspace(config, g.tiles, parts, g.batch_tile)
        kernel, grid = _kernel, (config.split_k, g.tiles)
    out_shape = [jax.ShapeDtypeStruct((batch, rows), out_dtype)] + workspace
    out = pl.pallas_call(
        functools.partial(
            kernel, geometry=g, situ=situ, out_dtype=out_dtype, interpret=interpret
        ),
        out_shape=out_shape,
        grid=grid,
        input_output_aliases={2: len(out_shape) - 1} if counters else {},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        name=name,
    )(x, w, *counters)
    return out[0]


def _check(x, gate_up, down, cfg, out_dtype) -> None:
    for name, array in (("x", x), ("gate_up", gate_up), ("down", down)):
        shape = getattr(array, "shape", None)
        if shape is None or len(shape) != 2 or array.dtype != jnp.bfloat16:
            raise ValueError(
                f"{name} must be a 2-D bfloat16 array, got {shape} {getattr(array, 'dtype', None)}"
            )
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    (batch, hidden), (two_s, gu_hidden) = x.shape, gate_up.shape
    if gu_hidden != hidden or two_s == 0 or two_s % 2:
        raise ValueError(
            f"gate_up must be [2 S_r, H={hidden}] with S_r >= 1, got {gate_up.shape}"
        )
    if down.shape != (hidden, two_s // 2):
        raise ValueError(
            f"down must be [H, S_r] = {(hidden, two_s // 2)} to match x and gate_up, got {down.shape}"
        )
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if batch == 0:
        raise ValueError(f"x is an empty batch (shape {x.shape}); B must be >= 1")
    if batch > MAX_BATCH:
        raise NotImplementedError(
            f"shared_expert covers B <= {MAX_BATCH} rows per call, got B={batch}; split the batch, "
            "or use backend='xla'"
        )
    if hidden % MIN_DOT or (two_s // 2) % MIN_DOT:
        raise NotImplementedError(
            f"shared_expert needs H and S_r to be multiples of {MIN_DOT}, got H={hidden}, "
            f"S_r={two_s // 2}; use backend='xla'"
        )


def gate_up_situ(
    x: jax.Array,
    gate_up: jax.Array,
    beta: float,
    linear_beta: float,
    *,
    interpret: bool = False,
    config: GemmConfig,
) -> jax.Array:
    """Kernel 1: ``situ(bf16(x @ gate.T), bf16(x @ up.T))`` ``[B, S_r]`` bfloat16, one pass over
    ``gate_up`` ``[2 S_r, H]`` (gate rows, then up rows)."""
    s_r = gate_up.shape[0] // 2
    situ = (float(beta), float(linear_beta))
    return _gemm(x, gate_up, s_r, jnp.bfloat16, config, situ, interpret, "shared_gate_up_situ")


def down_proj(
    hidden: jax.Array,
    down: jax.Array,
    out_dtype: jnp.dtype = jnp.bfloat16,
    *,
    interpret: bool = False,
    config: GemmConfig,
) -> jax.Array:
    """Kernel 2: ``hidden @ down.T`` ``[B, H]`` in ``out_dtype``, float32 accumulation, one pass over
    ``down`` ``[H, S_r]``."""
    return _gemm(hidden, down, down.shape[0], jnp.dtype(out_dtype), config, None, interpret,
                 "shared_down")


def down_proj_t(
    hidden_t: jax.Array,
    down: jax.Array,
    batch: int,
    out_dtype: jnp.dtype = jnp.bfloat16,
    *,
    interpret: bool = False,
    config: GemmConfig,
) -> jax.Array:
    """Kernel 2 on ``hidden`` given transposed: ``hidden_t`` ``[S_r, Bp]`` bfloat16 (``Bp >= B``,
    columns past ``batch`` zero), as the TMA gate/up with K split leaves it
    (``shared_expert_tma.gate_up_situ_t``, Bp = B rounded up to 8); ``[batch, H]`` in
    ``out_dtype``. Grid and stream-K schedules only. ``hidden_t`` is padded with zero columns to
    the kernel's batch tile (a power of two >= 16; XLA fuses the pad into the op that produced
    it), so that the kernel's loads of it are whole rows of 32 bytes or more, unmasked."""
    tile = padded_batch(batch)
    if hidden_t.shape[1] < tile:
        hidden_t = jnp.pad(hidden_t, ((0, 0), (0, tile - hidden_t.shape[1])))
    return _gemm(hidden_t, down, down.shape[0], jnp.dtype(out_dtype), config, None, interpret,
                 "shared_down", batch_t=batch)


def covers(x, gate_up, down, cfg, out_dtype=jnp.bfloat16) -> None:
    """Raise ``NotImplementedError`` where the kernels do not cover these arguments (``B > 256``, H
    or S_r not a multiple of 16), ``ValueError`` where they are wrong."""
    _check(x, gate_up, down, cfg, out_dtype)


def shared_expert(
    x: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    cfg: FrontConfig,
    out_dtype: jnp.dtype = jnp.bfloat16,
    *,
    interpret: bool = False,
    config: SharedExpertConfig | None = None,
) -> jax.Array:
    """The shared expert on one rank's slice (SPEC section 6); a partial sum when ``cfg.tp > 1``.

    Args:
      x: ``[B, H]`` bfloat16 decode rows, ``1 <= B <= 256``.
      gate_up: ``[2 S_r, H]`` bfloat16, this rank's gate rows then its up rows (``S_r = S / tp``).
      down: ``[H, S_r]`` bfloat16, this rank's columns of the down projection.
      cfg: the model's config (``situ_beta``, ``linear_beta``).
      out_dtype: bfloat16 (the SPEC's output) or float32 (a partial sum to reduce before rounding).
      interpret: run in Pallas' interpret mode (any machine).
      config: the two kernels' schedules; None picks the device's tuning-table entry or the
        heuristic.

    Returns:
      ``[B, H]`` ``out_dtype``: ``situ(bf16(gate), bf16(up)) @ down.T`` with float32 accumulation,
      as ``reference.shared_expert``.

    Raises:
      ValueError: wrong shapes or dtypes, a config that does not divide H or S_r.
      NotImplementedError: ``B > 256``, or H or S_r not a multiple of 16 (use ``backend='xla'``).

    Example::

      shared = shared_expert(x, params.gate_up, params.down, cfg)
    """
    _check(x, gate_up, down, cfg, out_dtype)
    s_r, hidden = down.shape[1], x.shape[1]
    config = config or pick_config(s_r, hidden, x.shape[0])
    if not isinstance(config, SharedExpertConfig):
        raise ValueError(f"config must be a SharedExpertConfig or None, got {type(config).__name__}")
    if config.gate_up.tma and config.down.tma:
        return shared_expert_tma.shared_expert(
            x, gate_up, down, cfg.situ_beta, cfg.linear_beta, out_dtype,
            gate_up_config=config.gate_up, down_config=config.down, interpret=interpret,
        )
    if (config.gate_up.tma and config.gate_up.split_k > 1 and not config.gate_up.batch_m
            and not config.down.vector):
        # hidden stays in the layout of the TMA kernel's partials (the batch minor): one XLA
        # fusion between the kernels instead of two. (batch_m's partials are batch-major: its
        # hidden goes to the down as it is, below.)
        h_t = shared_expert_tma.gate_up_situ_t(x, gate_up, cfg.situ_beta, cfg.linear_beta,
                                               config=config.gate_up, interpret=interpret)
        return down_proj_t(h_t, down, x.shape[0], out_dtype, interpret=interpret,
                           config=config.down)
    h = gate_up_situ(
        x, gate_up, cfg.situ_beta, cfg.linear_beta, interpret=interpret, config=config.gate_up
    )
    return down_proj(h, down, out_dtype, interpret=interpret, config=config.down)
