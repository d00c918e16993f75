"""The streaming engine: one Mosaic GPU launch streams a stack of weight row regions against ``x``.

Every CTA owns ``rows`` consecutive rows of one region over all of K (no split): a ring of
``num_stages`` TMA stages of ``block_k`` columns feeds wgmma with ``x``'s rows as M (64, of which
the copy fills B rounded up to 8) and the CTA's rows as N (tma.py's ``batch_m``). Each region has
its own epilogue on the accumulator registers, TMA-stored through shared memory: router rows ->
float32 logits (K cut into chains of at most ``fold_k``); latent rows -> bfloat16 latent (and its
MXFP8 plan; none at ``latent = 0``); gate/up pairs (two accumulators) -> ``activation(bf16(gate),
bf16(up))`` (situ or SiLU); down rows -> bfloat16, or a float32 partial.
The CTA -> region map is static; regions run biggest CTAs first; every kernel waits first thing
(``griddepcontrol_wait``) to be launched with PDL.

Cost per call (bf16 = 2 bytes; ``shard = n - split``):
  front     bytes = 2 (valid + shard) H            64.2 MB tp1, 8.0 MB tp8 (K3)
                  + 2 B H + 4 B valid + 2 B shard  x read, logits and latent written
                  + B shard (1 + 1/32)             the plan, when asked for
  gate/up   bytes += 2 * 2 S_r H + 2 B S_r         176.2 MB tp1, 22.0 MB tp8; hidden written
  down      bytes = 2 H S_r + 2 B S_r + B H (2|4)   88.1 MB tp1, 11.0 MB tp8
  x (or hidden), B rounded up to 8 rows (R), is re-read from L2 by every CTA: 2 R K bytes a
  CTA, not HBM traffic (at tp8, 64 rows came to 3x the weight's bytes); the pad writes
  them once, where XLA does not fold it into x's producer.
  FLOPs = 2 * 64 * (weight rows) * K on the tensor cores (M is 64 whatever B; 2 B per weight
  element useful): memory-bound at every B <= 64.
Timings, and why ``"auto"`` does not run it: docs/findings.md (the engine).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_front_jax import reference
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.device import core_count
from moe_front_jax.pallas.device import READ_CEILING_TBS
from moe_front_jax.pallas.gemm.mosaic import (
    WGMMA_M,
    WGMMA_MAX_N,
    WGMMA_N_STEP,
    WGMMA_STEPS_IN_FLIGHT,
    await_inputs,
    interpret_params,
    stage_transforms,
    tma_rows,
)
from moe_front_jax.pallas.gemm.schedule import FOLD_K, check_matrices
from moe_front_jax.pallas.plan.kernel import magnitude_bits, to_e4m3

MAX_BATCH = WGMMA_M
"""Largest batch: wgmma's M, the rows of ``x``'s slot in shared memory (``_stream``)."""
MAX_ROWS = WGMMA_MAX_N
"""Most weight rows per CTA (per part): wgmma's largest N."""
MAX_PAIR_ROWS = 128
"""Most gate (and as many up) rows per CTA: two ``[64, r]`` float32 accumulators take ``r``
registers a thread."""
ROW_STEP = WGMMA_N_STEP
"""CTA rows are a multiple of wgmma's N step."""
MAX_SMEM = 227 * 1024
"""Shared memory a Hopper CTA may have."""
RING_SMEM = 200 * 1024
"""The heuristic's TMA ring stays under this (of ``MAX_SMEM``); the epilogue's buffers reuse it once
the ring is drained."""
LOGITS, LATENT, GATE_UP, DOWN = "logits", "latent", "gate_up", "down"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Tiling of one engine launch.

    Attributes:
      router_rows, latent_rows, down_rows: weight rows per CTA of each region, a multiple of 8 up to
        256 (the latent's a multiple of the plan block where the plan is written).
      gate_up_rows: gate rows per CTA of the gate/up region (and as many up rows), a multiple of 8
        up to 128.
      block_k: K columns per TMA stage, a power of two from 32 to 512.
      num_stages: TMA stages in the ring, at least 2.
      fold_k: most K columns one accumulation chain of the logits covers (``chains_for``); a
        multiple of ``block_k``.
    """

    router_rows: int = 32
    latent_rows: int = 32
    gate_up_rows: int = 48
    down_rows: int = 56
    block_k: int = 128
    num_stages: int = 4
    fold_k: int = FOLD_K

    def __post_init__(self):
        name = type(self).__name__
        for field, most in (("router_rows", MAX_ROWS), ("latent_rows", MAX_ROWS),
                            ("down_rows", MAX_ROWS), ("gate_up_rows", MAX_PAIR_ROWS)):
            value = getattr(self, field)
            if type(value) is not int or value < ROW_STEP or value > most or value % ROW_STEP:
                raise ValueError(f"{name}.{field} must be a multiple of {ROW_STEP} from {ROW_STEP} "
                                 f"to {most}, got {value!r}")
        k = self.block_k
        if type(k) is not int or k < 32 or k > 512 or k & (k - 1):
            raise ValueError(f"{name}.block_k must be a power of two from 32 to 512, got {k!r}")
        if type(self.num_stages) is not int or self.num_stages < 2:
            raise ValueError(f"{name}.num_stages must be an int >= 2, got {self.num_stages!r}")
        if type(self.fold_k) is not int or self.fold_k < k or self.fold_k % k:
            raise ValueError(f"{name}.fold_k must be a positive multiple of block_k={k}, got "
                             f"{self.fold_k!r}")


@dataclasses.dataclass(frozen=True)
class Region:
    """Rows of one weight operand that one epilogue consumes.

    Attributes:
      kind: the epilogue (``LOGITS``, ``LATENT``, ``GATE_UP``, ``DOWN``).
      operand: index of the weight among the launch's weight operands.
      first_rows: the first row of each part (gate/up: the gate rows, then the up rows).
      rows: rows of each part.
      cta_rows: rows of each part per CTA; divides ``rows``.
      outputs: indices of the launch's outputs the epilogue writes.
    """

    kind: str
    operand: int
    first_rows: tuple[int, ...]
    rows: int
    cta_rows: int
    outputs: tuple[int, ...]

    @property
    def ctas(self) -> int:
        return self.rows // self.cta_rows


# --- tiling ------------------------------------------------------------------------------------------


def row_choices(rows: int, most: int, multiple: int = ROW_STEP) -> tuple[int, ...]:
    """CTA row counts that cut ``rows`` evenly: multiples of ``multiple`` (and of 8) up to
    ``most``."""
    step = multiple * ROW_STEP // math.gcd(multiple, ROW_STEP)
    return tuple(r for r in range(step, min(rows, most) + 1, step) if rows % r == 0)


def makespan(ctas: list[tuple[int, float]], cores: int) -> float:
    """The finish of the last SM when ``ctas`` (``(count, time)`` per region, in launch order) are
    handed, one at a time, to whichever of ``cores`` SMs is free first."""
    free = [0.0] * cores
    for count, time in ctas:
        for _ in range(count):
            heapq.heapreplace(free, free[0] + time)
    return max(free)


SM_SHARE = READ_CEILING_TBS * 1e6 / 132
"""One SM's share of the read ceiling (``device.READ_CEILING_TBS``), bytes per microsecond."""
LATENCY_US = 1.0
"""Round trip of a TMA stage under load: a ring keeps at most ``in flight / LATENCY_US`` coming."""
CTA_OVERHEAD_US = 1.0
"""A CTA's fixed cost: its launch, the ring's first round trip, the epilogue's store."""
X_COST = 0.25
"""A byte of ``x`` re-read from L2 costs a CTA this many bytes of weight."""
MAX_ACC_REGS = 128
"""Float32 accumulator registers a thread may hold: ``[64, rows]`` takes ``rows / 2``."""


def _cta_time(rows: int, parts: int, depth: int, x_rows: int, block_k: int, stages: int) -> float:
    """One CTA's time, us: ``CTA_OVERHEAD_US`` plus its bytes at the slower of its SM's share and
    what its ring keeps in flight (``stages - 1`` stages of weight per ``LATENCY_US``)."""
    weight = 2 * parts * rows * depth
    in_flight = 2 * (stages - 1) * block_k * parts * rows
    rate = min(SM_SHARE, in_flight / LATENCY_US)
    return CTA_OVERHEAD_US + (weight + X_COST * 2 * x_rows * depth) / rate


def _stages(block_k: int, weight_rows: int, depth: int) -> int:
    """Ring depth: as many stages as ``RING_SMEM`` holds, 2 to 6, no more than K's steps."""
    stage = 2 * block_k * (MAX_BATCH + weight_rows)
    return max(2, min(6, RING_SMEM // stage, depth // block_k))


def _block_ks(depth: int) -> tuple[int, ...]:
    wide = tuple(k for k in (128, 256, 512) if depth % k == 0)
    return wide or tuple(k for k in (64, 32) if depth % k == 0)[:1]


def cut(regions: tuple[tuple[int, int, int, int], ...], depth: int,
        cores: int) -> tuple[int, tuple[int, ...], int]:
    """``(block_k, CTA rows per region, stages)`` for regions ``(rows, parts, multiple, chains)``:
    the cut whose CTAs, longest first, end soonest on ``cores`` SMs (``makespan`` of
    ``_cta_time``, each SM at its share of the read rate: a model of a full machine); among
    equals, the one that keeps the most SMs busy, then the fewest CTAs. A CTA's accumulators
    (``parts`` or ``chains`` of them) stay within ``MAX_ACC_REGS``; its ring keeps 3 stages or
    more. Raises
    NotImplementedError where a region cannot be cut."""
    options = []
    for rows, parts, multiple, chains in regions:
        most = min(MAX_ROWS, 2 * MAX_ACC_REGS // max(parts, chains))
        choices = row_choices(rows, most, multiple)
        if not choices:
            raise NotImplementedError(
                f"the engine cuts {rows} rows into CTAs of a multiple of {multiple} rows up to "
                f"{most}: none divides {rows}; use another backend")
        options.append(choices)
    best = None
    for block_k in _block_ks(depth):
        for combo in itertools.product(*options):
            widest = max(parts * r for (_, parts, _, _), r in zip(regions, combo))
            stages = _stages(block_k, widest, depth)
            if stages < min(3, depth // block_k):
                continue
            times = [(rows // r, _cta_time(r, parts, depth, MAX_BATCH, block_k, stages))
                     for (rows, parts, _, _), r in zip(regions, combo)]
            ctas = sum(count for count, _ in times)
            span = round(makespan(sorted(times, key=lambda t: -t[1]), cores), 3)
            score = (span, -min(ctas, cores), ctas, block_k)
            if best is None or score < best[0]:
                best = score, (block_k, combo, stages)
    if best is None:
        raise NotImplementedError(f"no CTA cut of these regions ({regions}) fits shared memory")
    return best[1]


@functools.cache
def heuristic_config(depth: int, router: int = 0, latent: int = 0, gate_up: int = 0,
                     down: int = 0, plan_block: int = 0, cores: int = 132) -> EngineConfig:
    """A tiling for a device without a table (``cut``): rows of each present region (0 rows: the
    region is absent and keeps the default), ``block_k`` and the ring's depth; ``x`` ``[B, depth]``
    whatever B (wgmma's M is 64 rows at every B <= 64; each stage's box of ``x`` is B rounded up to
    8 rows: ``x_operand``)."""
    chains = chains_for(depth, FOLD_K, max(_block_ks(depth), default=32))
    present = [(name, rows, parts, multiple, c) for name, rows, parts, multiple, c in (
        ("router_rows", router, 1, ROW_STEP, chains),
        ("latent_rows", latent, 1, plan_block or ROW_STEP, 1),
        ("gate_up_rows", gate_up, 2, ROW_STEP, 1),
        ("down_rows", down, 1, ROW_STEP, 1)) if rows]
    block_k, combo, stages = cut(tuple(p[1:] for p in present), depth, cores)
    fields = {name: r for (name, *_), r in zip(present, combo)}
    return EngineConfig(**fields, block_k=block_k, num_stages=stages)


# --- the kernel --------------------------------------------------------------------------------------


def chains_for(depth: int, fold_k: int, block_k: int) -> int:
    """Accumulators of a logits CTA: K's chain cut so that none is longer than ``fold_k``, as a
    power of two (each K step's ``block_k`` columns are cut into that many slices)."""
    chains = 1
    while chains * fold_k < depth and chains * 16 < block_k:
        chains *= 2
    return chains


def _stream(x_gmem, views, tile, rows: int, config: EngineConfig, chains: int = 1,
            before_x=None):
    """The float32 ``[64, rows]`` accumulators of row tile ``tile`` of each of ``views`` (one per
    part) against ``x`` over all of K. With ``chains > 1`` (one view) each K step is cut into
    ``chains`` column slices, each accumulated apart and summed at the end, so that no tensor-core
    chain is longer than ``K / chains`` (``FOLD_K``).
    The ring: ``num_stages`` slots, each the parts' ``[rows, block_k]`` and a ``[64, block_k]`` slot
    of ``x`` whose first ``x_gmem.shape[0]`` rows (a multiple of 8) the TMA copy fills; the rows
    past them are never loaded, and only the accumulator rows they give (never stored) see them.
    ``before_x``: called between the ring's first weight copies and its first copies of ``x``
    (``await_inputs``, so that the weight streams in while the kernel before still runs)."""
    block_k = config.block_k
    steps = x_gmem.shape[1] // block_k
    stages = min(config.num_stages, steps)
    x_rows = x_gmem.shape[0]
    sub = block_k // chains
    transforms = stage_transforms(sub)
    parts = len(views)
    count = chains if chains > 1 else parts

    def scope(*refs):
        w_rings, (x_ring, landed) = refs[:parts], refs[parts:]

        def fetch_weights(step, slot):
            cols = pl.ds(step * block_k, block_k)
            for view, ring in zip(views, w_rings):
                plgpu.copy_gmem_to_smem(view.at[pl.ds(tile * rows, rows), cols], ring.at[slot],
                                        landed.at[slot])

        def fetch_x(step, slot):
            plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(step * block_k, block_k)],
                                    x_ring.at[slot, pl.ds(0, x_rows)], landed.at[slot])

        def fetch(step, slot):
            fetch_weights(step, slot)
            fetch_x(step, slot)

        for step in range(stages):
            fetch_weights(step, step)
        if before_x is not None:
            before_x()
        for step in range(stages):
            fetch_x(step, step)
        return pl.run_scoped(functools.partial(run, w_rings, x_ring, landed, fetch),
                             *[plgpu.ACC((MAX_BATCH, rows), jnp.float32)] * count)

    def run(w_rings, x_ring, landed, fetch, *accs):
        def body(step, carry):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(landed.at[slot])
            x_smem = x_ring.at[slot]
            if chains == 1:
                for acc, ring in zip(accs, w_rings):
                    plgpu.wgmma(acc, x_smem, ring.at[slot].T)
            else:
                (ring,) = w_rings
                for c, acc in enumerate(accs):
                    cols = pl.ds(c * sub, sub)
                    plgpu.wgmma(acc, x_smem.at[:, cols], ring.at[slot, :, cols].T)
            # The wgmmas of steps before the last WGMMA_STEPS_IN_FLIGHT are done: the slot of the
            # step before this one takes the step ``stages`` after it.
            plgpu.wgmma_wait(count * WGMMA_STEPS_IN_FLIGHT)
            refill = step - WGMMA_STEPS_IN_FLIGHT + stages

            @pl.when((step >= WGMMA_STEPS_IN_FLIGHT) & (refill < steps))
            def _():
                fetch(refill, lax.rem(refill, stages))

            return carry

        lax.fori_loop(0, steps, body, None)
        plgpu.wgmma_wait(0)
        if chains == 1:
            return tuple(acc[...] for acc in accs)
        total = accs[0][...]
        for acc in accs[1:]:
            total = total + acc[...]
        return (total,)

    ring = [plgpu.SMEM((stages, rows, block_k), jnp.bfloat16, transforms=transforms)] * parts
    ring += [plgpu.SMEM((stages, MAX_BATCH, block_k), jnp.bfloat16, transforms=transforms),
             plgpu.Barrier(num_arrivals=parts + 1, num_barriers=stages)]
    return pl.run_scoped(scope, *ring)


def _small_layout(bp: int):
    """A register layout for ``bp >= 2`` values, one a row (the plan's scale bytes of one block
    column): 8 rows to a tile, each held by 16 threads, where ``bp`` is a multiple of 8; else every
    row in every thread. Their stores repeat the same bytes."""
    if bp % 8 == 0:
        return plgpu.Layout.TILED(plgpu.Tiling(((8,), (1,))), warp_dims=(plgpu.Replicated(4),),
                                  lane_dims=(-2, plgpu.Replicated(4)), vector_dim=-1)
    return plgpu.Layout.TILED(plgpu.Tiling(((1,),)), warp_dims=(plgpu.Replicated(4),),
                              lane_dims=(plgpu.Replicated(32),), vector_dim=-1)


def _store(tiles, dsts, bp: int, columns=(), column_dsts=()) -> None:
    """Each ``[64, n]`` tile's first ``bp`` rows through shared memory, TMA-stored into its
    ``[bp, n]`` destination (every tile is written before any copy starts); and each ``[64]``
    column's first ``bp`` values, through shared memory, stored by the threads into its ``[bp]``
    destination (a TMA copy moves 16 bytes a row at least)."""

    def scope(*smems):
        column_smem = smems[-1] if columns else None
        for smem, tile in zip(smems, tiles):
            smem[...] = tile
        for j, column in enumerate(columns):
            column_smem.at[j][...] = column
        plgpu.commit_smem()
        for smem, dst in zip(smems, dsts):
            plgpu.copy_smem_to_gmem(smem.at[pl.ds(0, bp)], dst)
        for j, dst in enumerate(column_dsts):
            if bp == 1:  # one value: a scalar load and store (no layout has a single element)
                dst[0] = column_smem[j, 0]
            else:
                dst[...] = plgpu.load(column_smem.at[j, pl.ds(0, bp)], layout=_small_layout(bp))
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM(tile.shape, tile.dtype) for tile in tiles]
    if columns:
        scratch.append(plgpu.SMEM((len(columns), MAX_BATCH), columns[0].dtype))
    pl.run_scoped(scope, *scratch)


def plan_tile(latent, block: int):
    """The MXFP8 plan of a ``[64, rows]`` bfloat16 tile (in wgmma's accumulator layout), as
    ``reference.mxfp8_plan``: ``values`` ``[64, rows]`` float8_e4m3fn and one ``[64]`` uint8 column
    of E8M0 bytes per block. Each block's amax is a row max over its slice of the registers; its
    exponent is spread back over its columns by selects (Mosaic GPU has no concatenate)."""
    tile = latent.astype(jnp.float32)
    column_block = plgpu.broadcasted_iota(jnp.int32, tile.shape, 1,
                                          layout=plgpu.Layout.WGMMA) // block
    exponents, spread = [], None
    for j in range(tile.shape[1] // block):
        amax = jnp.max(magnitude_bits(tile[:, j * block:(j + 1) * block]), axis=1)
        exponent = reference.plan_scale_exponent(amax)
        exponents.append(exponent.astype(jnp.uint8))
        wide = jnp.broadcast_to(exponent[:, None], tile.shape)
        spread = wide if spread is None else jnp.where(column_block == j, wide, spread)
    return to_e4m3(tile, spread), exponents


@dataclasses.dataclass(frozen=True)
class _Epilogue:
    """What the epilogues need beyond the accumulators: the config whose activation gate/up takes
    (``reference.activation``: situ or SiLU), the down's dtype, the plan's block (0: no plan)."""

    cfg: FrontConfig | None = None
    out_dtype: object = jnp.bfloat16
    plan_block: int = 0


def _epilogue(region: Region, accs, outs, column, bp: int, ep: _Epilogue) -> None:
    rows = region.cta_rows
    dsts = [outs[i].at[pl.ds(0, bp), pl.ds(column, rows)] for i in region.outputs[:1]]
    if region.kind == LOGITS:
        tiles = [accs[0]]
    elif region.kind == LATENT:
        latent = accs[0].astype(jnp.bfloat16)
        if ep.plan_block:
            values, exponents = plan_tile(latent, ep.plan_block)
            _, values_out, scales_out = (outs[i] for i in region.outputs)
            first_block = column // ep.plan_block
            _store([latent, values], [*dsts, values_out.at[pl.ds(0, bp), pl.ds(column, rows)]],
                   bp, exponents,
                   [scales_out.at[pl.ds(0, bp), first_block + j] for j in range(len(exponents))])
            return
        tiles = [latent]
    elif region.kind == GATE_UP:
        gate, up = (acc.astype(jnp.bfloat16) for acc in accs)
        tiles = [reference.activation(gate, up, ep.cfg)]
    else:
        tiles = [accs[0].astype(ep.out_dtype)]
    _store(tiles, dsts, bp)


def x_operand(x) -> jax.Array:
    """``x`` ``[B, K]`` as a launch reads it, each stage's TMA box of it (``_stream``): B rounded up
    to a multiple of 8 rows, zero rows added in XLA (one small fusion), not wgmma's 64: at tp8 B=8
    a 64-row box made each CTA re-read 8x the bytes of ``x`` from L2 and the launch 18% slower
    (docs/findings.md, the layer kernel). The launch writes ``tma_rows(B)`` rows of each output."""
    rows = -(-x.shape[0] // 8) * 8
    return x if rows == x.shape[0] else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _launch(x, weights, regions: tuple[Region, ...], out_types, config: EngineConfig,
            ep: _Epilogue, interpret: bool, name: str):
    """One kernel over ``regions`` (biggest CTAs first) on ``x_operand(x)``; returns the
    outputs, each ``[tma_rows(B), ...]`` as ``out_types`` say."""
    bp = out_types[0].shape[0]
    chains = chains_for(x.shape[1], config.fold_k, config.block_k)
    order = sorted(regions, key=lambda r: -len(r.first_rows) * r.cta_rows)
    starts, total = [], 0
    for region in order:
        starts.append(total)
        total += region.ctas

    def kernel(x_gmem, *refs):
        w_gmems, outs = refs[: len(weights)], refs[len(weights):]
        await_inputs(interpret)
        cta = lax.axis_index("cta")
        for region, start in zip(order, starts):
            def run(region=region, start=start):
                tile = cta - start
                views = [w_gmems[region.operand].at[pl.ds(first, region.rows)]
                         for first in region.first_rows]
                accs = _stream(x_gmem, views, tile, region.cta_rows, config,
                               chains if region.kind == LOGITS else 1)
                _epilogue(region, accs, outs, tile * region.cta_rows, bp, ep)

            if len(order) == 1:
                run()
            else:
                pl.when((cta >= start) & (cta < start + region.ctas))(run)

    return plgpu.kernel(
        kernel, out_type=tuple(out_types), grid=(total,), grid_names=("cta",),
        interpret=interpret_params(interpret), kernel_name=name,
    )(x_operand(x), *weights)


# --- checks ------------------------------------------------------------------------------------------


def _check_x(x, name: str = "x") -> None:
    check_matrices(**{name: x})
    if x.shape[0] == 0:
        raise ValueError(f"{name} is an empty batch (shape {tuple(x.shape)}); B must be >= 1")
    if x.shape[0] > MAX_BATCH:
        raise NotImplementedError(
            f"the engine covers B <= {MAX_BATCH} rows (wgmma's M), got B={x.shape[0]}; split the "
            "batch, or use another backend")


def _check_depth(depth: int, config: EngineConfig | None, name: str) -> None:
    if config is None:
        if not _block_ks(depth):
            raise NotImplementedError(
                f"the engine streams K in steps of 32 columns or more: {name}={depth} is not a "
                "multiple of 32; use another backend")
    elif depth % config.block_k:
        raise ValueError(f"config {config} needs {name} divisible by block_k={config.block_k}, "
                         f"got {name}={depth}")


def _check_config(config) -> None:
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"config must be an EngineConfig or None, got {type(config).__name__}")


def _check_cut(what: str, rows: int, cta_rows: int) -> None:
    if rows % cta_rows:
        raise NotImplementedError(
            f"the engine cuts the {what} rows into CTAs of {cta_rows} rows: {rows} rows are not a "
            "multiple of it; pick another config, or use another backend")


def _check_front(x, packed, split, valid) -> None:
    _check_x(x)
    check_matrices(packed=packed)
    if packed.shape[1] != x.shape[1]:
        raise ValueError(f"packed must have x's width {x.shape[1]}, got {packed.shape[1]}")
    for name, value in (("split", split), ("valid", valid)):
        if type(value) is not int:
            raise ValueError(f"{name} must be a static int, got {value!r}")
    if not 0 < valid <= split <= packed.shape[0]:
        raise ValueError(f"need 0 < valid <= split <= rows of packed, got valid={valid}, "
                         f"split={split}, rows={packed.shape[0]}")


def _check_gate_up(x, gate_up) -> None:
    check_matrices(gate_up=gate_up)
    if gate_up.shape[1] != x.shape[1]:
        raise ValueError(f"gate_up must have x's width {x.shape[1]}, got {gate_up.shape[1]}")
    if gate_up.shape[0] == 0 or gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must hold 2 S_r rows (gate, then up), S_r >= 1, got "
                         f"{gate_up.shape[0]} rows")


def _front_config(x, packed, split, valid, gate_up_rows: int, plan_block: int,
                  config: EngineConfig | None, tiling_block: int = 0) -> EngineConfig:
    """The launch's tiling (``config``, else the heuristic's, its latent CTAs a multiple of
    ``tiling_block or plan_block`` rows), checked against the regions."""
    shard = packed.shape[0] - split
    depth = x.shape[1]
    if config is None:
        config = heuristic_config(depth, router=valid, latent=shard,
                                  gate_up=gate_up_rows, plan_block=tiling_block or plan_block,
                                  cores=core_count())
    _check_depth(depth, config, "hidden")
    _check_cut("router", valid, config.router_rows)
    _check_cut("latent", shard, config.latent_rows)
    if plan_block and config.latent_rows % plan_block:
        raise NotImplementedError(
            f"the plan's blocks of {plan_block} must not straddle CTAs: latent_rows="
            f"{config.latent_rows} is not a multiple of {plan_block}; pick another config")
    if gate_up_rows:
        _check_cut("gate/up", gate_up_rows, config.gate_up_rows)
    chains = chains_for(depth, config.fold_k, config.block_k)
    if chains * config.router_rows > 2 * MAX_ACC_REGS:
        raise ValueError(
            f"the logits' {chains} accumulators of router_rows={config.router_rows} take "
            f"{chains * config.router_rows // 2} registers a thread, over {MAX_ACC_REGS}; pick "
            "fewer router rows or a larger fold_k")
    _check_smem(config, max(config.router_rows, config.latent_rows if shard else 0,
                            2 * config.gate_up_rows if gate_up_rows else 0))
    return config


def _check_smem(config: EngineConfig, widest: int) -> None:
    ring = config.num_stages * 2 * config.block_k * (MAX_BATCH + widest)
    if ring > MAX_SMEM:
        raise ValueError(
            f"config {config}: a ring of {config.num_stages} stages of {config.block_k} columns "
            f"over {widest} weight rows and 64 of x takes {ring // 1024} KiB of shared memory, "
            f"over the {MAX_SMEM // 1024} KiB a CTA may have")


def covers_front_gate_up(x, packed, split, valid, gate_up, cfg, *, plan=False, config=None) -> None:
    """Raise ``NotImplementedError`` where ``front_gate_up`` does not cover these arguments (B > 64,
    a region's rows that no CTA cut divides; with ``plan``, latent CTAs not a multiple of
    ``cfg.plan_block`` rows), ``ValueError`` where they are wrong (the plan of no latent rows)."""
    _check_config(config)
    _check_front(x, packed, split, valid)
    _check_gate_up(x, gate_up)
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    _check_depth(x.shape[1], config, "hidden")
    if plan and not shard_of(packed, split):
        raise ValueError(f"plan=True needs latent rows, but packed has none (split={split} = "
                         "rows): a front without a latent (latent=0) has no MXFP8 plan")
    if plan and shard_of(packed, split) % cfg.plan_block:
        raise ValueError(f"the latent shard's {shard_of(packed, split)} rows must be a multiple of "
                         f"cfg.plan_block={cfg.plan_block}")
    _front_config(x, packed, split, valid, gate_up.shape[0] // 2,
                  cfg.plan_block if plan else 0, config, _tiling_block(packed, split, cfg))


def _tiling_block(packed, split: int, cfg: FrontConfig) -> int:
    """The merged front's heuristic tiles the latent in whole plan blocks whether or not the plan
    is written, so that a call with the plan and one without sum in the same order (the mailbox
    path, which plans after the collect, keeps the direct path's bits)."""
    return cfg.plan_block if shard_of(packed, split) % cfg.plan_block == 0 else 0


def shard_of(packed, split: int) -> int:
    return packed.shape[0] - split


def covers_down(hidden, down, out_dtype=jnp.bfloat16, *, config=None) -> None:
    """Raise ``NotImplementedError`` where ``down`` does not cover these arguments, ``ValueError``
    where they are wrong."""
    _check_config(config)
    _check_x(hidden, "hidden")
    check_matrices(down=down)
    if down.shape[1] != hidden.shape[1]:
        raise ValueError(f"down must have hidden's width {hidden.shape[1]}, got {down.shape[1]}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    _down_config(hidden, down, config)


def _down_config(hidden, down, config):
    depth = hidden.shape[1]
    _check_depth(depth, config, "S_r")
    if config is None:
        config = heuristic_config(depth, down=down.shape[0], cores=core_count())
    _check_cut("down", down.shape[0], config.down_rows)
    _check_smem(config, config.down_rows)
    return config


# --- entry points ------------------------------------------------------------------------------------


def _front_parts(valid: int, split: int, shard: int, bp: int, block: int,
                 config: EngineConfig) -> tuple[list[Region], list]:
    """The router and latent regions (none for the latent where ``shard`` is 0) and their outputs:
    the logits, then the latent and, with the plan (``block``), its values and scale bytes."""
    regions = [Region(LOGITS, 0, (0,), valid, config.router_rows, (0,))]
    outs = [jax.ShapeDtypeStruct((bp, valid), jnp.float32)]
    if shard:
        regions.append(Region(LATENT, 0, (split,), shard, config.latent_rows,
                              (1, 2, 3) if block else (1,)))
        outs.append(jax.ShapeDtypeStruct((bp, shard), jnp.bfloat16))
    if shard and block:
        outs += [jax.ShapeDtypeStruct((bp, shard), jnp.float8_e4m3fn),
                 jax.ShapeDtypeStruct((bp, shard // block), jnp.uint8)]
    return regions, outs


def _front_results(out, batch: int, shard: int, plan: bool):
    """``(logits, latent, plan or None)``, B rows each, from a launch's outputs (``_front_parts``'
    first); a latent of no columns where ``shard`` is 0."""
    if not shard:
        return out[0][:batch], jnp.zeros((batch, 0), jnp.bfloat16), None
    if not plan:
        return out[0][:batch], out[1][:batch], None
    scales = lax.bitcast_convert_type(out[3][:batch], jnp.float8_e8m0fnu)
    return out[0][:batch], out[1][:batch], (out[2][:batch], scales)


def front_gate_up(x, packed, split: int, valid: int, gate_up, cfg: FrontConfig, *,
                  plan: bool = False, config: EngineConfig | None = None,
                  interpret: bool = False):
    """The merged front: one launch over ``[router; latent; gate; up]``.

    Args:
      x: ``[B, H]`` bfloat16, ``1 <= B <= 64``.
      packed: ``[split + shard, H]`` bfloat16: router rows ``[0, valid)``, rows up to ``split``
        never read, latent rows ``[split, split + shard)``; ``split``, ``valid`` static ints.
      gate_up: ``[2 S_r, H]`` bfloat16, this rank's gate rows then its up rows.
      cfg: supplies the activation (``reference.activation``) and ``plan_block``; ``plan``: also
        write the latent's MXFP8 plan; ``config`` None picks ``heuristic_config``.

    Returns ``(logits [B, valid] float32, latent [B, shard] bfloat16, plan (values, scales) or
    None, hidden [B, S_r] bfloat16)``, as the reference up to float32 summation order; ``shard``
    may be 0 (a front without a latent: no latent rows streamed, no plan).
    """
    covers_front_gate_up(x, packed, split, valid, gate_up, cfg, plan=plan, config=config)
    s_r = gate_up.shape[0] // 2
    config = _front_config(x, packed, split, valid, s_r, cfg.plan_block if plan else 0, config,
                           _tiling_block(packed, split, cfg))
    batch, shard = x.shape[0], packed.shape[0] - split
    block = cfg.plan_block if plan else 0
    regions, outs = _front_parts(valid, split, shard, tma_rows(batch), block, config)
    regions.append(Region(GATE_UP, 1, (0, s_r), s_r, config.gate_up_rows, (len(outs),)))
    outs.append(jax.ShapeDtypeStruct((tma_rows(batch), s_r), jnp.bfloat16))
    out = _launch(x, (packed, gate_up), tuple(regions), outs, config,
                  _Epilogue(cfg, plan_block=block), interpret,
                  "engine_front_gate_up_plan" if plan else "engine_front_gate_up")
    return (*_front_results(out, batch, shard, plan), out[-1][:batch])


def down(hidden, down, out_dtype=jnp.bfloat16, *, config: EngineConfig | None = None,
         interpret: bool = False):
    """``hidden @ down.T`` ``[B, H]`` in ``out_dtype`` (bfloat16, or a float32 partial sum under
    tp) from ``hidden`` ``[B, S_r]`` and ``down`` ``[H, S_r]``, both bfloat16, float32
    accumulation; ``B <= 64``."""
    covers_down(hidden, down, out_dtype, config=config)
    config = _down_config(hidden, down, config)
    batch, rows = hidden.shape[0], down.shape[0]
    (out,) = _launch(
        hidden, (down,), (Region(DOWN, 0, (0,), rows, config.down_rows, (0,)),),
        (jax.ShapeDtypeStruct((tma_rows(batch), rows), out_dtype),), config,
        _Epilogue(out_dtype=out_dtype), interpret, "engine_down")
    return out[:batch]
