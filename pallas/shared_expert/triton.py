"""The shared expert as two Pallas Triton kernels (SPEC section 6): gate/up with situ in its
epilogue, then down.

    hidden = situ(bf16(x @ gate.T), bf16(x @ up.T))   [B, S_r] bfloat16               (kernel 1)
    shared = hidden @ down.T                          [B, H] out_dtype, float32 sums  (kernel 2)

The float32 gate and up never leave kernel 1. Under tp the result is this rank's float32 partial,
reduced by the caller. Each kernel runs its own schedule (``gemm.schedule``): the grid with split-K,
stream-K or the vector schedule here, or the TMA schedule of ``tma`` (Mosaic GPU), which the tuned
tables run at tp1 (H200 tp1 B=1-64: 62.8-69.0 us a call against XLA's 67.7-86.5, docs/findings.md).

Both GEMMs are bound by reading their weight once. Situ needs gate row j and up row j in one
program, so a gate/up program streams two row blocks ``S_r`` apart (two slabs, as cheap as one of
twice the height) and the weight keeps its checkpoint layout. A tp8 rank's 768 gate rows are too few
tiles for 132 SMs, so K is split. Where a TMA gate/up splits K, ``hidden`` stays as its partials
lie, ``[S_r, Bp]``, for ``down_proj_t``: one XLA fusion between the kernels instead of two. Both
GEMMs in one launch was slower at every shape, in Triton and Mosaic GPU (docs/findings.md).

Cost per call (bf16 = 2 bytes; ``s1``, ``s2`` the kernels' split_k):
  bytes = 2 * 3 S_r H                   both weights: 264.2 MB at tp1, 33.0 MB at tp8 for K3
        + 2 B H + 4 B S_r               x read, hidden written and read back
        + B H size(out_dtype)           shared written
        + 8 B (2 S_r s1 + H s2)         partials written and read back, when K is split
  FLOPs = 6 B S_r H                     (+ about 20 FLOPs and 3 transcendentals per hidden element)
Floor on an H200 (4.65 TB/s): 56.8 us at tp1, 7.1 us at tp8.
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
from moe_front_jax.pallas.device import tuning_entries
from moe_front_jax.pallas.gemm import schedule
from moe_front_jax.pallas.gemm import triton as gemm_triton
from moe_front_jax.pallas.gemm.schedule import (  # SMEM_BUDGET: the heuristic's, re-exported
    MIN_DOT,
    SMEM_BUDGET,
    GemmConfig,
    padded_batch,
)
from moe_front_jax.pallas.shared_expert import tma as shared_expert_tma


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
    return f"shared={shared_per_rank},hidden={hidden},batch={schedule.batch_key(batch)}"


def load_table(kind: str) -> dict[str, SharedExpertConfig]:
    """The tuning table of device ``kind``: ``key -> config`` (empty where there is none)."""
    return {key: SharedExpertConfig.from_json(entry)
            for key, entry in tuning_entries(kind, "shared_expert").items()}


def heuristic_config(shared_per_rank: int, hidden: int, batch: int, cores: int) -> SharedExpertConfig:
    """Schedules for a device without a table (``gemm.schedule.heuristic``): gate/up
    programs take 16 gate + 16 up rows up to a batch tile of 32, twice that above (each tile re-reads
    ``x`` from L2); down programs 32 rows, 64 above a batch tile of 64."""
    bp = padded_batch(batch)
    gate_rows = 16 if bp <= 32 else 32
    down_rows = 32 if bp <= 64 else 64
    return SharedExpertConfig(
        schedule.heuristic(-(-shared_per_rank // gate_rows), hidden, gate_rows, batch, cores,
                           parts=2),
        schedule.heuristic(-(-hidden // down_rows), shared_per_rank, down_rows, batch, cores),
    )


def pick_config(shared_per_rank: int, hidden: int, batch: int) -> SharedExpertConfig:
    """The target device's table entry for this shape (``gemm.schedule.lookup``), else
    ``heuristic_config``."""
    return schedule.lookup(load_table, lambda size: table_key(shared_per_rank, hidden, size), batch,
                         lambda cores: heuristic_config(shared_per_rank, hidden, batch, cores))


def auto_prefers_kernel(x, gate_up, down, cfg, out_dtype=jnp.bfloat16) -> bool:
    """``backend="auto"``'s choice for ``shared_expert(x, gate_up, down, cfg, out_dtype)``: True
    where the target device's auto table measured these kernels faster than
    ``reference.shared_expert`` at these shapes (``gemm.schedule.auto_prefers``). The table's runs
    are in the dtype ``moe_front`` asks for (bfloat16 at tp1, the float32 partial under tp)."""
    del gate_up, cfg, out_dtype
    return schedule.auto_prefers("shared_expert", x, down,
                        lambda: table_key(down.shape[1], x.shape[1], x.shape[0]))


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


def _stream_k_kernel(x_ref, w_ref, counters_in_ref, out_ref, partials_ref, counters_ref, *,
                     geometry: Geometry, situ, out_dtype, interpret: bool):
    """One stream-K program of either GEMM (``gemm.triton.stream_k``), as ``_kernel``'s tiles."""
    del counters_in_ref  # aliased to counters_ref
    g = geometry
    sk = gemm_triton.StreamK.of(g.config, g.tiles, g.depth)

    def segment(tile, lo, hi):
        first_row, row_ok, batch_ok, first_rows, rows_mask, batch_mask = _tile(g, situ, tile)
        accs = _stream(x_ref, w_ref, first_rows, g, rows_mask, batch_mask, lo, hi - lo)
        return accs, lambda *ys: _store_tile(out_ref, ys, g, first_row, row_ok, batch_ok, situ,
                                             out_dtype)

    batch_ok = lax.broadcasted_iota(jnp.int32, (1, g.batch_tile), 1) < g.batch
    gemm_triton.stream_k(sk, partials_ref, counters_ref, segment,
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
    config.check_batch(batch)
    kernel = _vector_kernel if config.vector else _stream_k_kernel if config.programs else _kernel
    (out, *_) = gemm_triton.launch(
        functools.partial(kernel, geometry=g, situ=situ, out_dtype=out_dtype, interpret=interpret),
        x, w, config=config, tiles=g.tiles, depth=depth, parts=2 if situ else 1,
        batch_tile=g.batch_tile, out_shape=[jax.ShapeDtypeStruct((batch, rows), out_dtype)],
        interpret=interpret, name=name,
    )
    return out


def _check(x, gate_up, down, cfg, out_dtype) -> None:
    schedule.check_matrices(x=x, gate_up=gate_up, down=down)
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
    schedule.check_batch_covered("shared_expert", batch)
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
    (``tma.gate_up_situ_t``, Bp = B rounded up to 8); ``[batch, H]`` in
    ``out_dtype``. Grid and stream-K schedules only. ``hidden_t`` is padded with zero columns to
    the kernel's batch tile (a power of two >= 16; XLA fuses the pad into the op that produced
    it), so that the kernel's loads of it are whole rows of 32 bytes or more, unmasked."""
    tile = padded_batch(batch)
    if hidden_t.shape[1] < tile:
        hidden_t = jnp.pad(hidden_t, ((0, 0), (0, tile - hidden_t.shape[1])))
    return _gemm(hidden_t, down, down.shape[0], jnp.dtype(out_dtype), config, None, interpret,
                 "shared_down", batch_t=batch)


def check_situ(cfg: FrontConfig) -> None:
    """Raise ``NotImplementedError`` unless the shared expert's activation is ``situ``, the one its
    epilogues compute."""
    if cfg.activation != "situ":
        raise NotImplementedError(
            f"the shared-expert kernels apply situ; activation={cfg.activation!r} runs the "
            "reference")


def covers(x, gate_up, down, cfg, out_dtype=jnp.bfloat16) -> None:
    """Raise ``NotImplementedError`` where the kernels do not cover these arguments (``B > 256``, H
    or S_r not a multiple of 16, an activation other than situ), ``ValueError`` where they are
    wrong."""
    _check(x, gate_up, down, cfg, out_dtype)
    check_situ(cfg)


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
    covers(x, gate_up, down, cfg, out_dtype)
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
