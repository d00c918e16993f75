"""The shared expert's two GEMMs in Mosaic GPU: Hopper's TMA copies into warpgroup MMAs.

The TMA schedule of ``shared_expert`` (``TmaConfig``, B <= 64): ``hidden = situ(bf16(x @ gate.T),
bf16(x @ up.T))``, then ``hidden @ down.T``. Each CTA is one warpgroup that streams 64 weight rows
(gate/up: and the matching up rows) over its ``K / split_k`` chunk through ``emit_pipeline``'s ring
of ``num_stages`` TMA stages of ``block_k`` columns into wgmma. The copy engine keeps the weight in
flight with no thread issuing loads, which a read at the HBM rate needs (docs/findings.md, the TMA
schedule). The weight tile is wgmma's M and the batch, padded to a multiple of 8
(``tma_batch_rows``), its N. With ``batch_m`` the batch is M (64 rows) and a CTA's rows, any
multiple of 8, are N, so tp1 fills 128 SMs instead of 96 and 112 (faster on one device kind, not on
another: the tables choose).

The epilogues run on the accumulators' registers (gate/up: bf16 rounding and situ; down: bf16) and
TMA-store the tile through shared memory. Where K is split (tp8: 768 gate rows are 12 CTAs) or the
output is float32, CTAs store float32 partials and XLA sums them and runs the epilogue as one
fusion; the gate/up's ``hidden`` is left as the partials lie, ``[S_r, Bp]`` (``gate_up_situ_t``).
Each kernel waits first thing for the one before, to be launched with PDL
(``gemm.mosaic.LAUNCH_WITH_PDL``).

Cost per call (bf16 = 2 bytes; ``Bp`` the padded batch; ``s1``, ``s2`` the kernels' split_k):
  bytes = 2 * 3 S_r H                  both weights, read once: 264.2 MB at tp1, 33.0 MB at tp8
        + 4 Bp S_r H / block_rows      x and hidden re-read from L2 by every CTA (not HBM)
        + 2 B S_r + 2 B H              hidden and shared written
        + 8 Bp (2 S_r s1 + H s2)       partials written and read back by XLA, where used
  FLOPs = 6 Bp S_r H                   on the tensor cores (Bp >= 8; 64 with batch_m)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_front_jax import reference
from moe_front_jax.pallas.gemm.mosaic import (
    WGMMA_M,
    WGMMA_MAX_N,
    WGMMA_N_STEP,
    WGMMA_STEPS_IN_FLIGHT,
    await_inputs,
    interpret_params,
    pad_rows,
    stage_transforms,
)
from moe_front_jax.pallas.gemm.schedule import MIN_DOT, ConfigChecks

TMA_ROWS = WGMMA_M
"""Weight rows per CTA (per part) without ``batch_m``: one warpgroup's wgmma M (CTAs of 128 rows
were slower, docs/findings.md)."""
TMA_MAX_ROWS_N = WGMMA_MAX_N
"""Most weight rows per CTA (per part) with ``batch_m``: wgmma's largest N."""
TMA_MAX_BATCH = WGMMA_M
"""Largest batch: the gate/up accumulators take ``2 * 64 * Bp / 128`` float32 registers a thread
(``Bp`` the batch rounded up to 8); with ``batch_m`` it is wgmma's M."""


@dataclasses.dataclass(frozen=True)
class TmaConfig(ConfigChecks):
    """The TMA schedule of one of the shared expert's GEMMs (Mosaic GPU): one warpgroup per
    ``block_rows`` weight rows over a ``K / split_k`` chunk, through a ring of ``num_stages`` TMA
    stages of ``block_k`` columns into wgmma; with ``split_k > 1`` XLA sums the float32 partials.

    Attributes:
      block_rows: ``TMA_ROWS`` (wgmma's M); with ``batch_m`` a multiple of 8 up to
        ``TMA_MAX_ROWS_N`` (wgmma's N, the batch padded to ``TMA_MAX_BATCH`` being M).
      block_k: a power of two >= 16; K must be a multiple of ``split_k * block_k``.
      split_k: K chunks, >= 1.
      num_stages: TMA stages in the ring, >= 2.
      batch_m: the operands the other way round, so that tiles can be cut to fill the SMs.
    """

    IMPLEMENTATION: ClassVar[str] = "mosaic_tma"
    POWERS_OF_TWO: ClassVar[dict[str, int]] = {"block_k": MIN_DOT}
    POSITIVE: ClassVar[tuple[str, ...]] = ("split_k",)
    K_STEP: ClassVar[tuple[str, ...]] = ("split_k", "block_k")
    block_rows: int
    block_k: int
    split_k: int
    num_stages: int
    batch_m: bool = False

    def __post_init__(self):
        name = type(self).__name__
        if type(self.batch_m) is not bool:
            raise ValueError(f"{name}.batch_m must be a bool, got {self.batch_m!r}")
        rows, step = self.block_rows, WGMMA_N_STEP
        if self.batch_m and not (type(rows) is int and rows % step == 0
                                 and step <= rows <= TMA_MAX_ROWS_N):
            raise ValueError(f"{name}.block_rows with batch_m (wgmma's N) must be a multiple of "
                             f"{step} from {step} to {TMA_MAX_ROWS_N}, got {rows!r}")
        if not self.batch_m and rows != TMA_ROWS:
            raise ValueError(f"{name}.block_rows must be {TMA_ROWS} (wgmma's M), got {rows!r}")
        super().__post_init__()
        if type(self.num_stages) is not int or self.num_stages < 2:
            raise ValueError(f"{name}.num_stages must be an int >= 2, got {self.num_stages!r}")


def tma_batch_rows(batch: int) -> int:
    """The batch rows the TMA copies and wgmma's N: ``batch`` rounded up to a multiple of 8."""
    return -(-batch // 8) * 8


def _stream(x_gmem, w_gmem, first_tiles, config: TmaConfig, bp: int, part=0):
    """The float32 accumulators of the weight's row tiles ``first_tiles`` (counted in
    ``block_rows``) against ``x`` over K chunk ``part`` of ``split_k``: ``num_stages`` TMA stages of
    ``block_k`` columns in flight. Each is ``[block_rows, bp]`` (the weight tile is wgmma's M), or
    with ``batch_m`` ``[TMA_MAX_BATCH, block_rows]`` (``x``'s rows are M, those past its own zero
    filled by the copy)."""
    rows, block_k, depth = config.block_rows, config.block_k, config.num_stages
    x_rows = TMA_MAX_BATCH if config.batch_m else bp
    steps = x_gmem.shape[1] // block_k // config.split_k
    first_step = part * steps
    transforms = stage_transforms(block_k)
    parts = len(first_tiles)

    def scope(*accs):
        def body(_, *smem):
            *w_smem, x_smem = smem
            for acc, w in zip(accs, w_smem):
                if config.batch_m:
                    plgpu.wgmma(acc, x_smem, w.T)
                else:
                    plgpu.wgmma(acc, w, x_smem.T)
            # The wgmmas of steps before the last WGMMA_STEPS_IN_FLIGHT are done: their slots may
            # be refilled.
            plgpu.wgmma_wait(parts * WGMMA_STEPS_IN_FLIGHT)

        w_specs = [
            plgpu.BlockSpec((rows, block_k), lambda k, t=t: (t, first_step + k),
                            transforms=transforms, delay_release=WGMMA_STEPS_IN_FLIGHT)
            for t in first_tiles
        ]
        x_spec = plgpu.BlockSpec((x_rows, block_k), lambda k: (0, first_step + k),
                                 transforms=transforms, delay_release=WGMMA_STEPS_IN_FLIGHT)
        plgpu.emit_pipeline(
            body, grid=(steps,), in_specs=[*w_specs, x_spec], max_concurrent_steps=depth
        )(*[w_gmem] * parts, x_gmem)
        return tuple(acc[...] for acc in accs)

    acc_shape = (x_rows, rows) if config.batch_m else (rows, bp)
    return pl.run_scoped(scope, *[plgpu.ACC(acc_shape, jnp.float32)] * parts)


def _store_transposed(tile_t, out_gmem, column):
    """A ``[rows, bp]`` bfloat16 tile, transposed through shared memory, TMA-stored into
    ``out_gmem[:, column : column + rows]`` (rows past the output's clipped)."""
    rows, bp = tile_t.shape

    def scope(smem):
        smem.T[...] = tile_t
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_gmem.at[pl.ds(0, bp), pl.ds(column, rows)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM((bp, rows), jnp.bfloat16))


def _store_rows(tile, out_gmem, column, bp: int):
    """The first ``bp`` rows of a ``[TMA_MAX_BATCH, rows]`` bfloat16 tile (``batch_m``), through
    shared memory, TMA-stored into ``out_gmem[:bp, column : column + rows]`` (rows past the
    output's clipped)."""
    m, rows = tile.shape

    def scope(smem):
        smem[...] = tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem.at[pl.ds(0, bp)],
                                out_gmem.at[pl.ds(0, bp), pl.ds(column, rows)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM((m, rows), jnp.bfloat16))


def _store_partials(tiles, dst_gmem):
    """The float32 tiles through one shared-memory buffer, TMA-stored into ``dst_gmem``
    ``[len(tiles), m, n]`` (``[rows, bp]``, or ``[bp, rows]`` of ``[TMA_MAX_BATCH, rows]`` tiles
    with ``batch_m``): every tile is written before any copy starts, so no shared memory is
    rewritten while a copy may still read it."""
    m = dst_gmem.shape[1]

    def scope(smem):
        for i, tile in enumerate(tiles):
            smem.at[i][...] = tile
        plgpu.commit_smem()
        for i in range(len(tiles)):
            plgpu.copy_smem_to_gmem(smem.at[i, pl.ds(0, m)], dst_gmem.at[i])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM((len(tiles), *tiles[0].shape), jnp.float32))


def _partials(x, w, parts: int, config: TmaConfig, interpret: bool, name: str):
    """Split-K (or float32-output) form of either kernel: CTA ``(part, tile)`` streams K chunk
    ``part`` of the ``parts`` row blocks of ``tile`` (gate/up: its gate rows and the up rows
    ``S_r`` below) and stores its float32 accumulators; XLA sums the ``[split_k, parts, rows / parts,
    bp]`` partials (``[split_k, parts, bp, rows / parts]`` with ``batch_m``) and runs the epilogue
    (one small fusion)."""
    rows = config.block_rows
    bp, tiles = tma_batch_rows(x.shape[0]), w.shape[0] // parts // rows

    def kernel(x_gmem, w_gmem, out_gmem):
        await_inputs(interpret)
        part, tile = lax.axis_index("part"), lax.axis_index("tile")
        accs = _stream(x_gmem, w_gmem, tuple(tile + p * tiles for p in range(parts)), config, bp,
                       part)
        columns = pl.ds(tile * rows, rows)
        _store_partials(accs, out_gmem.at[part, :, :, columns] if config.batch_m
                        else out_gmem.at[part, :, columns])

    shape = (bp, tiles * rows) if config.batch_m else (tiles * rows, bp)
    out = jax.ShapeDtypeStruct((config.split_k, parts, *shape), jnp.float32)
    return plgpu.kernel(
        kernel, out_type=out, grid=(config.split_k, tiles), grid_names=("part", "tile"),
        interpret=interpret_params(interpret), kernel_name=name,
    )(x, w)


def _check(x, w, rows: int, config: TmaConfig, name: str) -> None:
    if not isinstance(config, TmaConfig):
        raise ValueError(f"{name}: config must be a TmaConfig, got {config!r}")
    batch, depth_k = x.shape
    if batch > TMA_MAX_BATCH:
        raise NotImplementedError(
            f"the TMA schedule covers B <= {TMA_MAX_BATCH}, got B={batch}; use another schedule"
        )
    if rows % config.block_rows:
        raise NotImplementedError(
            f"the TMA schedule of {name} needs its rows a multiple of block_rows="
            f"{config.block_rows}, got {rows}; use another schedule"
        )
    config.check_divides(depth_k, "K")


def _split_hidden(x, gate_up, beta, linear_beta, config: TmaConfig, interpret: bool):
    """Kernel 1 with K split, on ``pad_rows(x)``: ``hidden`` in the layout its partials lie in,
    ``hidden.T`` ``[S_r, Bp]`` (the batch minor; ``[Bp, S_r]`` with ``batch_m``), so that XLA's
    sum over the splits, rounding and situ are one fusion (a transpose makes it two, slower:
    docs/findings.md). Rows or columns past B are ``situ(0, 0) = 0``."""
    y = _partials(x, gate_up, 2, config, interpret, "shared_gate_up_tma_partials").sum(0)
    gate, up = (reference.round_to_bfloat16(y[p]) for p in range(2))
    return reference.situ(gate, up, beta, linear_beta)


def _hidden_t(x, gate_up, beta, linear_beta, config: TmaConfig, interpret: bool):
    """``hidden.T`` ``[S_r, Bp]`` from ``_split_hidden`` (a transpose with ``batch_m``)."""
    hidden = _split_hidden(x, gate_up, beta, linear_beta, config, interpret)
    return hidden.T if config.batch_m else hidden


def _gate_up(x, gate_up, beta, linear_beta, config: TmaConfig, interpret: bool):
    """Kernel 1 on ``pad_rows(x)``: its rows of ``hidden``."""
    s_r = gate_up.shape[0] // 2
    rows = config.block_rows
    batch, bp, tiles = x.shape[0], tma_batch_rows(x.shape[0]), s_r // rows
    if config.split_k > 1:
        hidden = _split_hidden(x, gate_up, beta, linear_beta, config, interpret)
        return hidden[:batch] if config.batch_m else hidden[:, :batch].T

    def kernel(x_gmem, w_gmem, out_gmem):
        await_inputs(interpret)
        tile = lax.axis_index("tile")
        gate, up = _stream(x_gmem, w_gmem, (tile, tile + tiles), config, bp)
        hidden = reference.situ(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), beta,
                                linear_beta)
        if config.batch_m:
            _store_rows(hidden, out_gmem, tile * rows, bp)
        else:
            _store_transposed(hidden, out_gmem, tile * rows)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, s_r), jnp.bfloat16), grid=(tiles,),
        grid_names=("tile",), interpret=interpret_params(interpret),
        kernel_name="shared_gate_up_situ_tma",
    )(x, gate_up)


def _down(hidden, down, out_dtype, config: TmaConfig, interpret: bool):
    """Kernel 2 on ``pad_rows(hidden)``: its rows of the product."""
    batch, rows, bp = hidden.shape[0], down.shape[0], tma_batch_rows(hidden.shape[0])
    if config.split_k > 1 or jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
        y = _partials(hidden, down, 1, config, interpret, "shared_down_tma_partials").sum(0)[0]
        return (y[:batch] if config.batch_m else y[:, :batch].T).astype(out_dtype)

    def kernel(h_gmem, w_gmem, out_gmem):
        await_inputs(interpret)
        tile = lax.axis_index("tile")
        (acc,) = _stream(h_gmem, w_gmem, (tile,), config, bp)
        store = functools.partial(_store_rows, bp=bp) if config.batch_m else _store_transposed
        store(acc.astype(jnp.bfloat16), out_gmem, tile * config.block_rows)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, rows), jnp.bfloat16),
        grid=(rows // config.block_rows,),
        grid_names=("tile",), interpret=interpret_params(interpret), kernel_name="shared_down_tma",
    )(hidden, down)


def gate_up_situ(x, gate_up, beta: float, linear_beta: float, *, config: TmaConfig,
                 interpret: bool = False):
    """Kernel 1: ``situ(bf16(x @ gate.T), bf16(x @ up.T))`` ``[B, S_r]`` bfloat16 from ``x``
    ``[B, H]`` and ``gate_up`` ``[2 S_r, H]`` (gate rows, then up rows), both bfloat16."""
    _check(x, gate_up, gate_up.shape[0] // 2, config, "gate_up")
    hidden = _gate_up(pad_rows(x), gate_up, beta, linear_beta, config, interpret)
    return hidden[: x.shape[0]]


def gate_up_situ_t(x, gate_up, beta: float, linear_beta: float, *, config: TmaConfig,
                   interpret: bool = False):
    """Kernel 1 with K split (``config.split_k > 1``), transposed: ``hidden.T`` ``[S_r, Bp]``
    bfloat16 (``Bp`` = B rounded up to 8; its columns past B zero), for a down kernel that reads
    ``hidden`` so (``triton.down_proj_t``); ``gate_up_situ`` is this, sliced and
    transposed."""
    _check(x, gate_up, gate_up.shape[0] // 2, config, "gate_up")
    if config.split_k == 1:
        raise ValueError(f"gate_up_situ_t needs K split (split_k > 1), got {config}")
    return _hidden_t(pad_rows(x), gate_up, beta, linear_beta, config, interpret)


def down_proj(hidden, down, out_dtype=jnp.bfloat16, *, config: TmaConfig,
              interpret: bool = False):
    """Kernel 2: ``hidden @ down.T`` ``[B, H]`` in ``out_dtype`` from ``hidden`` ``[B, S_r]`` and
    ``down`` ``[H, S_r]``, both bfloat16, float32 accumulation."""
    _check(hidden, down, down.shape[0], config, "down")
    return _down(pad_rows(hidden), down, out_dtype, config, interpret)[: hidden.shape[0]]


def shared_expert(x, gate_up, down, beta: float, linear_beta: float, out_dtype=jnp.bfloat16, *,
                  gate_up_config: TmaConfig, down_config: TmaConfig, interpret: bool = False):
    """Both kernels: ``down_proj(gate_up_situ(x, ...), ...)`` ``[B, H]`` in ``out_dtype``, with
    ``hidden`` passed between them in the rows the TMA copies (one pad and one slice at most)."""
    _check(x, gate_up, gate_up.shape[0] // 2, gate_up_config, "gate_up")
    hidden = _gate_up(pad_rows(x), gate_up, beta, linear_beta, gate_up_config, interpret)
    _check(hidden, down, down.shape[0], down_config, "down")
    return _down(hidden, down, out_dtype, down_config, interpret)[: x.shape[0]]
