"""The shared expert's two GEMMs as Pallas Triton kernels, each on a grid (split-K) or vector
schedule (``gemm.schedule``); ``kernel`` composes them into the stage.

    hidden = situ(bf16(x @ gate.T), bf16(x @ up.T))   [B, S_r] bfloat16               (gate/up)
    shared = hidden @ down.T                          [B, H] out_dtype, float32 sums  (down)

The float32 gate and up never leave the gate/up kernel: situ needs gate row j and up row j in one
program, so a program streams two row blocks ``S_r`` apart and the weight keeps its checkpoint
layout. ``down_proj_t`` reads ``hidden`` transposed, as a split TMA gate/up leaves it.

Cost per call (bf16 = 2 bytes; ``s1``, ``s2`` the kernels' split_k):
  bytes = 2 * 3 S_r H                   both weights
        + 2 B H + 4 B S_r               x read, hidden written and read back
        + B H size(out_dtype)           shared written
        + 8 B (2 S_r s1 + H s2)         partials written and read back, when K is split
  FLOPs = 6 B S_r H                     (+ about 20 FLOPs and 3 transcendentals per hidden element)
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
from moe_front_jax.pallas.gemm import triton as gemm_triton
from moe_front_jax.pallas.gemm.schedule import GridConfig, VectorConfig, padded_batch

TritonSharedConfig = GridConfig | VectorConfig
"""The schedules of either Triton kernel: the grid with split-K, or the vector schedule."""


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one GEMM of a call: ``rows`` output rows (per part) over K = ``depth``;
    ``x_t``: ``x`` comes transposed, ``[depth, batch_tile]``, its columns past ``batch`` zero."""

    batch: int
    depth: int
    rows: int
    config: TritonSharedConfig
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
            xs = gemm_triton.masked_load(x_ref.at[pl.ds(0, bp), pl.ds(k, bk)], batch_mask)
        out = []
        for acc, first in zip(accs, first_rows):
            # The weight is read once per call: first out of L2, so x and the partials stay.
            w = gemm_triton.masked_load(w_ref.at[pl.ds(first, bn), pl.ds(k, bk)], rows_mask,
                                        "evict_first")
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
    gemm_triton.finish_split_k(
        accs, partials_ref, counters_ref, split_k=split_k, part=pl.program_id(0), tile=tile,
        mask=None if batch_mask is None else batch_mask.T, interpret=interpret,
        epilogue=lambda *ys: _store_tile(out_ref, ys, g, first_row, row_ok, batch_ok, situ,
                                         out_dtype),
    )


def _vector_kernel(x_ref, w_ref, out_ref, *, geometry: Geometry, situ, out_dtype, interpret: bool):
    """One program of either GEMM on the vector schedule (``gemm.triton.vector_stream``): one tile of
    rows (and, for gate/up, the up rows ``geometry.rows`` below) over all of K, then the epilogue."""
    del interpret
    g, bn = geometry, geometry.config.block_rows
    first_row = pl.program_id(0) * bn
    row_ok = (first_row + lax.broadcasted_iota(jnp.int32, (bn,), 0)) < g.rows
    ragged = g.rows % bn != 0
    first_rows = (first_row, first_row + g.rows) if situ else (first_row,)
    parts = gemm_triton.vector_stream(
        x_ref, w_ref, first_rows, batch=g.batch, depth=g.depth, config=g.config,
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
    tile]``, columns past ``batch_t`` zero; the grid schedule)."""
    x_t = batch_t is not None
    batch, depth = (batch_t, x.shape[0]) if x_t else x.shape
    if not isinstance(config, TritonSharedConfig):
        raise ValueError(f"config must be a GridConfig or VectorConfig, got {config!r}")
    if x_t and isinstance(config, VectorConfig):
        raise ValueError(f"a transposed hidden needs a grid schedule, got {config}")
    config.check_divides(depth, "K")
    g = Geometry(batch, depth, rows, config, x_t)
    if x_t and x.shape[1] != g.batch_tile:
        raise ValueError(f"hidden.T must have the batch tile's {g.batch_tile} columns, got {x.shape}")
    if isinstance(config, VectorConfig):
        config.check_batch(batch)
    kernel = _vector_kernel if isinstance(config, VectorConfig) else _kernel
    (out, *_) = gemm_triton.launch(
        functools.partial(kernel, geometry=g, situ=situ, out_dtype=out_dtype, interpret=interpret),
        x, w, config=config, tiles=g.tiles, depth=depth, parts=2 if situ else 1,
        batch_tile=g.batch_tile, out_shape=[jax.ShapeDtypeStruct((batch, rows), out_dtype)],
        interpret=interpret, name=name,
    )
    return out


def gate_up_situ(
    x: jax.Array,
    gate_up: jax.Array,
    beta: float,
    linear_beta: float,
    *,
    interpret: bool = False,
    config: TritonSharedConfig,
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
    config: TritonSharedConfig,
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
    config: TritonSharedConfig,
) -> jax.Array:
    """Kernel 2 on ``hidden`` given transposed: ``hidden_t`` ``[S_r, Bp]`` bfloat16 (``Bp >= B``,
    columns past ``batch`` zero), as the TMA gate/up with K split leaves it
    (``tma.gate_up_situ_t``, Bp = B rounded up to 8); ``[batch, H]`` in
    ``out_dtype``. Grid schedule only. ``hidden_t`` is padded with zero columns to
    the kernel's batch tile (a power of two >= 16; XLA fuses the pad into the op that produced
    it), so that the kernel's loads of it are whole rows of 32 bytes or more, unmasked."""
    tile = padded_batch(batch)
    if hidden_t.shape[1] < tile:
        hidden_t = jnp.pad(hidden_t, ((0, 0), (0, tile - hidden_t.shape[1])))
    return _gemm(hidden_t, down, down.shape[0], jnp.dtype(out_dtype), config, None, interpret,
                 "shared_down", batch_t=batch)


def check_situ(cfg) -> None:
    """Raise ``NotImplementedError`` unless the shared expert's activation is ``situ``, the one its
    epilogues compute."""
    if cfg.activation != "situ":
        raise NotImplementedError(
            f"the shared-expert kernels apply situ; activation={cfg.activation!r} runs the "
            "reference")
