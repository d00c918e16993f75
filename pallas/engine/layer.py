"""The layer kernel: one persistent Mosaic GPU launch streams a rank's front and shared expert.

A grid of at most ``core_count()`` CTAs, each taking most of an SM's shared memory, so that all are
resident at once. Each CTA runs a static queue of tiles (``schedule``), read from a table operand:
first the merged front's tiles (router rows -> logits, latent rows -> latent and its MXFP8 plan,
gate/up pairs -> ``hidden``), then the down's (``hidden`` -> the shared expert's output). A tile is
one of the engine's CTAs (``kernel._stream``, ``kernel._epilogue``): its rows over all of K through
the TMA ring, then its epilogue.

The hand-off: each gate/up tile signals a global semaphore once its ``hidden`` stores are complete;
a down tile first waits until the semaphore has counted every gate/up tile (``memory_scope="gpu"``,
async-proxy fences on both sides, since TMA writes and reads ``hidden``). Every queue holds its
front tiles before its down tiles, so a CTA that starts late can stall the launch but never
deadlock it. Mosaic GPU's interpret mode runs no semaphores: there the same table runs as two
launches, the front tiles, then the down tiles.

With PDL, each CTA's first weight copies start before ``griddepcontrol_wait``, and its last tile
lets the next kernel launch, whose CTAs then take the SMs this one frees (``_kernel``).

Cost: ``kernel.front_gate_up``'s bytes plus ``kernel.down``'s (``kernel``'s docstring); ``hidden``
``[x rows, S_r]`` bf16 (``x_operand``'s rows) goes through L2, written once, re-read by every down
tile. The semaphore is a 4-byte global that XLA zero-fills before each launch (one small kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.device import core_count
from moe_front_jax.pallas.engine.kernel import (
    DOWN,
    GATE_UP,
    LOGITS,
    MAX_BATCH,
    EngineConfig,
    Region,
    _cta_time,
    _down_config,
    _Epilogue,
    _epilogue,
    _front_config,
    _front_parts,
    _front_results,
    _stream,
    _tiling_block,
    chains_for,
    covers_down,
    covers_front_gate_up,
    x_operand,
)
from moe_front_jax.pallas.gemm.mosaic import (
    await_inputs, interpret_params, release_dependents, tma_rows)

NO_TILE = -1
"""A queue's entry past its last tile."""


@dataclasses.dataclass(frozen=True)
class Queues:
    """The launch's tiles and who runs them.

    Attributes:
      regions: the regions in tile order (the front's, longest tiles first; the down last).
      starts: the number of each region's first tile; tile ``t`` of the launch is tile
        ``t - starts[i]`` of the region ``i`` whose range holds it.
      table: ``[ctas, depth]`` int32, each CTA's tiles in the order it runs them, ``NO_TILE`` after
        its last.
    """

    regions: tuple[Region, ...]
    starts: tuple[int, ...]
    table: np.ndarray

    def region_of(self, tile: int) -> int:
        return max(i for i, start in enumerate(self.starts) if start <= tile)

    def at_step(self, step: int) -> tuple[int, ...]:
        """The regions whose tiles some CTA runs at ``step`` of its queue."""
        return tuple(sorted({self.region_of(t) for t in self.table[:, step] if t != NO_TILE}))


def schedule(times: list[tuple[int, float]], after: int, ctas: int) -> np.ndarray:
    """Each CTA's queue (``Queues.table``) for regions of ``(tiles, time)``, in tile order: list
    scheduling, each tile to the CTA that frees first. The tiles of regions ``after`` and on start
    no sooner than every earlier tile ends (the hand-off), so they come after the front's in every
    queue; there a tie goes to the CTA whose own tiles ended first (an idle one first), then to the
    lower CTA."""
    free = [(0.0, 0.0, cta) for cta in range(ctas)]  # (free from, own tiles' end, cta)
    queues = [[] for _ in range(ctas)]
    tile = 0
    for i, (count, time) in enumerate(times):
        if i == after:
            ready = max(t for t, _, _ in free)
            free = sorted((max(t, ready), end, cta) for t, end, cta in free)
        for _ in range(count):
            start, _, cta = heapq.heappop(free)
            queues[cta].append(tile)
            heapq.heappush(free, (start + time, start + time, cta))
            tile += 1
    depth = max(len(q) for q in queues)
    return np.array([q + [NO_TILE] * (depth - len(q)) for q in queues], np.int32)


def queues(front: tuple[Region, ...], down: Region, front_config: EngineConfig,
           down_config: EngineConfig, front_depth: int, down_depth: int, ctas: int) -> Queues:
    """The launch's ``Queues``: the front regions longest tiles first, then the down, over
    ``min(ctas, tiles)`` CTAs, each tile's time from the engine's model (``kernel._cta_time``) over
    its K (``H``, and ``S_r`` for the down)."""
    def time(region, config, depth):
        return _cta_time(region.cta_rows, len(region.first_rows), depth, MAX_BATCH,
                         config.block_k, config.num_stages)

    timed = sorted(((r, time(r, front_config, front_depth)) for r in front),
                   key=lambda rt: -rt[1])
    timed.append((down, time(down, down_config, down_depth)))
    regions = tuple(r for r, _ in timed)
    starts = tuple(int(s) for s in np.cumsum([0] + [r.ctas for r in regions])[:-1])
    total = sum(r.ctas for r in regions)
    table = schedule([(r.ctas, t) for r, t in timed], len(front), min(ctas, total))
    return Queues(regions, starts, table)


def _fence_async_global() -> None:
    """Order this CTA's generic-proxy accesses (the semaphore) with its TMA (async-proxy) ones."""
    plgpu.inline_mgpu()(lambda ctx: mgpu.utils.inline_ptx(
        "fence.proxy.async.global;", has_side_effects=True))()


def _kernel(table_ref, x_gmem, packed, gate_up, down, *outs, plan: Queues, front_config,
            down_config, ep: _Epilogue, bp: int, phase: str, interpret: bool):
    """``phase``: ``"layer"`` (every tile, the hand-off by the semaphore), ``"front"`` or ``"down"``
    (interpret mode's two launches; ``"down"`` reads ``hidden`` from ``x_gmem``).
    PDL: a CTA's first front tile starts its weight's copies before ``await_inputs`` (a first
    down tile waits before it reads the semaphore); at its last tile the CTA lets the next kernel
    launch (``release_dependents``). Nothing is written before the wait."""
    cta = lax.axis_index("cta")
    hidden = x_gmem if phase == "down" else outs[-1]
    gate_up_tiles = sum(r.ctas for r in plan.regions if r.kind == GATE_UP)
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if phase == "layer" else None
    chains = chains_for(x_gmem.shape[1], front_config.fold_k, front_config.block_k)

    wait = functools.partial(await_inputs, interpret)

    def run(region: Region, tile, opens: bool, last):
        """Tile ``tile`` of ``region``; ``opens``: the CTA's first tile; ``last``: its last."""
        is_down = region.kind == DOWN
        if is_down and opens:
            wait()
        if is_down and sem is not None:
            plgpu.semaphore_wait(sem, gate_up_tiles, decrement=False, memory_scope="gpu")
            _fence_async_global()
        pl.when(last)(functools.partial(release_dependents, interpret))
        weight = (packed, gate_up, down)[region.operand]
        views = [weight.at[pl.ds(first, region.rows)] for first in region.first_rows]
        accs = _stream(hidden if is_down else x_gmem, views, tile, region.cta_rows,
                       down_config if is_down else front_config,
                       chains if region.kind == LOGITS else 1,
                       before_x=wait if opens and not is_down else None)
        rows = x_gmem.shape[0] if region.kind == GATE_UP else bp  # the rows the down reads
        _epilogue(region, accs, outs, tile * region.cta_rows, rows, ep)
        if region.kind == GATE_UP and sem is not None:
            _fence_async_global()
            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

    depth = plan.table.shape[1]
    for step in range(depth):
        tile = table_ref[cta, step]
        last = (table_ref[cta, step + 1] == NO_TILE) if step + 1 < depth else True
        for i in plan.at_step(step):
            region, start = plan.regions[i], plan.starts[i]
            if phase != "layer" and (phase == "down") != (region.kind == DOWN):
                continue  # interpret mode: the other launch's tile
            pl.when((tile >= start) & (tile < start + region.ctas))(
                functools.partial(run, region, tile - start, step == 0, last))


def layer(x, packed, split: int, valid: int, gate_up, down, cfg: FrontConfig, *,
          plan: bool = False, out_dtype=jnp.bfloat16, front_config: EngineConfig | None = None,
          down_config: EngineConfig | None = None, interpret: bool = False):
    """A rank's front and shared expert in one launch (module docstring).

    Args:
      x: ``[B, H]`` bfloat16, ``1 <= B <= 64``.
      packed, split, valid, gate_up, cfg, plan: as ``kernel.front_gate_up``.
      down: ``[H, S_r]`` bfloat16, this rank's down columns.
      out_dtype: bfloat16, or float32 for a partial sum under tp.
      front_config, down_config: the front's and the down's tilings (None: the heuristic's).

    Returns ``(logits [B, valid] f32, latent [B, shard] bf16, plan (values, scales) or None,
    shared [B, H] out_dtype)``, each as ``front_gate_up`` and ``down`` give it.
    """
    covers_layer(x, packed, split, valid, gate_up, down, cfg, plan=plan, out_dtype=out_dtype,
                 front_config=front_config, down_config=down_config)
    s_r, hidden_width = gate_up.shape[0] // 2, x.shape[1]
    block = cfg.plan_block if plan else 0
    front_config = _front_config(x, packed, split, valid, s_r, block, front_config,
                                 _tiling_block(packed, split, cfg))
    down_config = _down_config(jax.ShapeDtypeStruct((x.shape[0], s_r), jnp.bfloat16), down,
                               down_config)
    batch, shard = x.shape[0], packed.shape[0] - split
    bp = tma_rows(batch)
    x_in = x_operand(x)
    front, outs = _front_parts(valid, split, shard, bp, block, front_config)
    front.append(Region(GATE_UP, 1, (0, s_r), s_r, front_config.gate_up_rows, (len(outs) + 1,)))
    shared = Region(DOWN, 2, (0,), hidden_width, down_config.down_rows, (len(outs),))
    outs += [jax.ShapeDtypeStruct((bp, hidden_width), out_dtype),
             jax.ShapeDtypeStruct((x_in.shape[0], s_r), jnp.bfloat16)]
    work = queues(tuple(front), shared, front_config, down_config, hidden_width, s_r,
                  core_count())
    ep = _Epilogue(cfg, out_dtype, block)
    table = jnp.asarray(work.table)
    call = functools.partial(_call, work, front_config, down_config, ep, bp, interpret)
    if interpret:
        out = call("front", outs, (table, x_in, packed, gate_up, down))
        hidden = out[-1]
        shared_out = call("down", outs, (table, hidden, packed, gate_up, down))[-2]
    else:
        out = call("layer", outs, (table, x_in, packed, gate_up, down))
        shared_out = out[-2]
    return (*_front_results(out, batch, shard, plan), shared_out[:batch])


def _call(work: Queues, front_config, down_config, ep, bp, interpret, phase, out_types,
          operands):
    """One launch of ``_kernel`` in ``phase``, with every output of the layer (a phase of
    interpret mode leaves the other phase's outputs unwritten)."""
    kernel = functools.partial(_kernel, plan=work, front_config=front_config,
                               down_config=down_config, ep=ep, bp=bp, phase=phase,
                               interpret=interpret)
    return plgpu.kernel(
        kernel, out_type=tuple(out_types), grid=(work.table.shape[0],), grid_names=("cta",),
        interpret=interpret_params(interpret), kernel_name=f"engine_layer_{phase}",
    )(*operands)


def covers_layer(x, packed, split, valid, gate_up, down, cfg, *, plan=False,
                 out_dtype=jnp.bfloat16, front_config=None, down_config=None) -> None:
    """``covers_front_gate_up`` and ``covers_down`` of the layer's two halves (``down`` ``[H,
    S_r]`` against ``gate_up``'s ``S_r``)."""
    covers_front_gate_up(x, packed, split, valid, gate_up, cfg, plan=plan, config=front_config)
    s_r = gate_up.shape[0] // 2
    if down.ndim != 2 or down.shape != (x.shape[1], s_r):
        raise ValueError(f"down must be [H, S_r] = [{x.shape[1]}, {s_r}] (x's width, gate_up's "
                         f"rows / 2), got shape {tuple(down.shape)}")
    covers_down(jax.ShapeDtypeStruct((x.shape[0], s_r), jnp.bfloat16), down, out_dtype,
                config=down_config)
