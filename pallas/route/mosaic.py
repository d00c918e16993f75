"""Exact top-k routing (SPEC section 4) and the dispatch order (SPEC 4.1) as Mosaic GPU kernels.

``route``: one CTA per row of ``logits`` ``[B, E]``, each of its four warps holding the whole row,
``E / 32`` keys a lane (``ROW``), so that every reduction stays in a warp (``redux.sync``) and gives
every thread the same value: a scalar. Keys: ``kernel.ordered_keys``' int32. Each lane caches its
best ``CACHED`` (key, expert) pairs; a round takes the top by two one-register max reductions (the
key, then the lowest expert holding it) and moves the winning lane's cache up; a lane that wins with
nothing cached behind it refills from its keys ranked below the one just chosen (under a
``lax.cond`` on a reduced flag): fewer than a third of random rows refill, and every third round
refills where one lane holds all the winners. Why: Mosaic GPU in jax 0.11.2 has no argmax, sort,
cumsum, gather or popcount, but it lowers max reductions over a register layout, ``lax.cond`` on a
scalar, scalar loads and stores at any index. The chosen logits are loaded again; their sigmoids,
the tree sum and the correctly rounded division (``arith.divf``) run on scalars, as
``reference.routing_weights``.

``permutation``, a second launch (a grid-wide hand-off in one launch needs semaphores, which Mosaic
GPU's interpret mode does not run): slot ``s``'s position is its rank among ``id * S' + s``, each
expert's group size a count; both are ``[64, 64]`` comparisons (the wgmma register layout) summed
over every slot, by one CTA per 64 slots (their ranks, ``inverse``; ``order[inverse[s]] = s`` by
scalar stores) or per 64 experts. Integers only: ``reference.routing.permutation``'s bits.

Cost: ``route_bytes`` ``= 4BE + 4E + 10BK`` (7.3 KB at B = 1, 243 KB at 64, K3); a row takes ``3K``
one-register warp reductions (two dependent a round) and ``2 CACHED`` passes over its keys per fill.
``permute_bytes`` ``= 4S'(S'/64 + E/64) + 12S + 4E`` from L2 (``S = BK``, ``S' = max(S, 64)``; 7.6
KB at B = 1, 139 KB at 64, 1.3 MB at 256) and ``S'(S' + E)`` comparisons: quadratic in B.
Latency-bound; measured in ``benchmarks/bench_route.py`` beside the Triton kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_front_jax import reference
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.gemm.mosaic import await_inputs
from moe_front_jax.pallas.route.kernel import (
    NAN_KEY, PAD_KEY, _check, _check_ids, check_plain_routing)

LANES = 32
"""Experts a warp's lanes hold side by side: ``route`` needs ``E`` a multiple of it."""
BLOCK = 64
"""Slots or experts a CTA of ``permutation`` owns, and slots it compares them with per step: the
rows and columns of a wgmma-layout ``[64, 64]`` tile. ``permutation`` needs ``E`` a multiple of it."""
MAX_PERMUTE_ROWS = 256
"""Largest batch whose dispatch order ``permutation`` writes: its comparisons grow as ``(B K)^2``."""

ROW = plgpu.Layout.TILED(plgpu.Tiling(((1, LANES), (1,))), warp_dims=(plgpu.Replicated(4),),
                         lane_dims=(-2,), vector_dim=-1)
"""A row of ``E`` experts as ``[E / 32, 32]``: expert ``32 j + lane`` in register ``j`` of every
warp's lane ``lane``."""
CACHED = 3
"""Keys each lane of ``route`` keeps sorted in registers: the fewest refills per pass spent on
random rows (docs/findings.md, Routing); a fill costs two passes over a lane's keys per key."""
EVERY = plgpu.Layout.TILED(plgpu.Tiling(((1,),)), warp_dims=(plgpu.Replicated(4),),
                           lane_dims=(plgpu.Replicated(32),), vector_dim=-1)
"""A short vector (a row's ``top_k`` ids or weights) that every thread holds whole."""
TILE = plgpu.Layout.WGMMA
MINE, THEIRS = TILE.reduce(1), TILE.reduce(0)
"""A ``[64]`` vector along the tile's rows (the CTA's own slots or experts), along its columns (the
slots compared with them)."""


def _barrier() -> None:
    """A warpgroup barrier (shared memory written by some threads, then read by all). Interpret
    mode, where a CTA is one thread, leaves it out (``interpret_params``)."""
    plgpu.inline_mgpu()(lambda ctx: mgpu.warpgroup_barrier())()


def interpret_params(interpret: bool):
    """Mosaic GPU's interpret mode where ``interpret`` (``_barrier`` left out), else None."""
    return plgpu.InterpretGPUParams(inline_mgpu="ignore") if interpret else None


def _div(x, y, interpret: bool):
    """Correctly rounded float32 ``x / y``: ``arith.divf``, ``div.rn.f32``, on the GPU. In interpret
    mode XLA would turn a division into a multiplication by the reciprocal where it can: the
    denominator goes through a barrier, as in ``reference.routing``."""
    return x / (lax.optimization_barrier(y) if interpret else y)


def _sigmoid(x, interpret: bool):
    one = jnp.float32(1)
    return _div(one, one + jnp.exp(-x), interpret)


def _ordered(key):
    """``kernel.ordered_keys``' int32 image of float32 ``key`` (NaN to ``NAN_KEY``)."""
    bits = lax.bitcast_convert_type(key, jnp.int32)
    ordered = jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))
    return jnp.where(key != key, jnp.int32(NAN_KEY), ordered)


def _tree_sum(values):
    """``((v0+v1)+(v2+v3))+...`` over a list of float32 scalars, padded with zeros to a power of two
    (``reference.tree_sum``)."""
    width = 1 << max(len(values) - 1, 0).bit_length()
    values = list(values) + [jnp.float32(0)] * (width - len(values))
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def _route_kernel(logits_ref, bias_ref, ids_ref, weights_ref, *, cfg, interpret):
    await_inputs(interpret)
    row = lax.axis_index("row")
    k, experts = cfg.top_k, cfg.experts
    x = plgpu.load(logits_ref.at[row], layout=ROW, optimized=False)
    b = plgpu.load(bias_ref, layout=ROW, optimized=False)
    keys = _ordered(_sigmoid(x, interpret) + b)
    shape = keys.shape
    # Experts numbered from the top, so that a max reduction finds the lowest expert of a tie.
    rev = (experts - 1) - (plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=ROW) * LANES
                           + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=ROW))
    wide = lambda lane_values: plgpu.layout_cast(
        jnp.broadcast_to(lane_values[None, :], shape), ROW)
    pad = jnp.int32(PAD_KEY)

    def best(valid):
        """Each lane's ``CACHED`` best keys among ``valid`` and their experts, best first, as
        ``[32]`` vectors, one value a lane (``PAD_KEY`` and -1 where a lane has no more)."""
        cache = []
        for _ in range(CACHED):
            key = jnp.max(jnp.where(valid, keys, pad), axis=0)
            expert = jnp.max(jnp.where(valid & (keys == wide(key)), rev, -1), axis=0)
            cache += [key, expert]
            valid = valid & (rev != wide(expert))
        return tuple(cache)

    cache = best(keys > pad)
    chosen = []
    for r in range(k):
        top = jnp.max(cache[0])
        winner = jnp.max(jnp.where(cache[0] == top, cache[1], -1))
        # A lane holding the top with nothing cached behind it: after this round it looks again.
        stale = jnp.max(jnp.where((cache[0] == top) & (cache[2] == pad), 1, 0))
        chosen.append((experts - 1) - winner)
        won = cache[1] == winner
        cache = tuple(jnp.where(won, behind, held) for held, behind in
                      zip(cache, cache[2:] + (pad, jnp.int32(-1))))
        if r + 1 < k:
            # The experts not chosen yet: those ranked below the one just chosen.
            below = (keys < top) | ((keys == top) & (rev < winner))
            cache = lax.cond(stale > 0, lambda below=below: best(below),
                             lambda cache=cache: cache)
    # The chosen logits again (scalar loads, L1 hits): the sigmoids the keys were made of.
    scores = [_sigmoid(logits_ref[row, e // LANES, e % LANES], interpret) for e in chosen]
    w = [jnp.where(s != s, jnp.float32(0), s) for s in scores]
    scale = jnp.float32(cfg.routed_scaling_factor)
    if cfg.renormalize:
        total = _tree_sum(w) + jnp.float32(reference.RENORM_EPSILON)
        w = [_div(v * scale, total, interpret) for v in w]
    else:
        w = [v * scale for v in w]
    slot = plgpu.broadcasted_iota(jnp.int32, (k,), 0, layout=EVERY)
    ids = jnp.zeros((k,), jnp.int32)
    weights = jnp.zeros((k,), jnp.float32)
    for r in range(k):
        ids = jnp.where(slot == r, chosen[r], ids)
        weights = jnp.where(slot == r, w[r], weights)
    ids_ref[row] = ids
    weights_ref[row] = weights.astype(jnp.bfloat16)


def _chunks(total: int):
    """The column steps over ``total >= 64`` entries: step ``i`` loads ``[start, start + 64)`` with
    ``start = min(64 i, total - 64)`` and counts only the entries from ``64 i`` on (the last step
    overlaps the one before where ``total`` is not a multiple of 64)."""
    return -(-total // BLOCK)


def _permute_kernel(flat_ref, order_ref, sizes_ref, inverse_ref, *, slots, padded, interpret):
    await_inputs(interpret)
    cta = lax.axis_index("cta")
    slot_ctas = _chunks(padded)
    column = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1, layout=TILE)

    def count(mine, hit, keyed: bool):
        """``[64]`` counts, along the rows: for each of ``mine`` (``MINE``), how many of all
        ``padded`` ids (``THEIRS``; ``keyed``: as ``key``s) it ``hit``s."""
        def step(i, acc):
            start = jnp.minimum(i * BLOCK, padded - BLOCK)
            theirs = plgpu.load(flat_ref.at[pl.ds(start, BLOCK)], layout=THEIRS, optimized=False)
            if keyed:
                theirs = key(theirs, start, THEIRS)
            fresh = start + column >= i * BLOCK
            return acc + jnp.where(hit(mine[:, None], theirs[None, :]) & fresh, 1, 0)

        acc = lax.fori_loop(0, _chunks(padded), step, jnp.zeros((BLOCK, BLOCK), jnp.int32))
        return jnp.sum(acc, axis=1)

    def key(ids, start, layout):
        """``(expert, slot)`` as one int32 in their order, for the ids of slots ``start + i``;
        padding (expert ``E``) past them all."""
        return ids * padded + start + plgpu.broadcasted_iota(jnp.int32, (BLOCK,), 0, layout=layout)

    @pl.when(cta < slot_ctas)
    def _():
        start = jnp.minimum(cta * BLOCK, padded - BLOCK)
        ids = plgpu.load(flat_ref.at[pl.ds(start, BLOCK)], layout=MINE, optimized=False)
        inverse = count(key(ids, start, MINE), lambda mine, theirs: theirs < mine, keyed=True)

        def scatter(held):
            held[...] = inverse
            _barrier()
            for i in range(min(BLOCK, slots)):  # padding slots (slots < 64) stay out
                position = held[i]
                order_ref[position] = start + i
                if slots < BLOCK:
                    inverse_ref[i] = position

        pl.run_scoped(scatter, plgpu.SMEM((BLOCK,), jnp.int32))
        if slots >= BLOCK:
            inverse_ref[pl.ds(start, BLOCK)] = inverse

    @pl.when(cta >= slot_ctas)
    def _():
        first = (cta - slot_ctas) * BLOCK
        expert = first + plgpu.broadcasted_iota(jnp.int32, (BLOCK,), 0, layout=MINE)
        sizes_ref[pl.ds(first, BLOCK)] = count(expert, lambda mine, theirs: theirs == mine,
                                               keyed=False)


def route_bytes(batch: int, experts: int, top_k: int) -> int:
    """Bytes ``route`` moves: logits and bias read, the chosen logits again, ids and weights."""
    return 4 * batch * experts + 4 * experts + 4 * batch * top_k + 6 * batch * top_k


def permute_bytes(batch: int, experts: int, top_k: int) -> int:
    """Bytes ``permutation`` moves (L2-resident): every id read once per CTA, its outputs written."""
    slots = batch * top_k
    padded = max(slots, BLOCK)
    return 4 * padded * (_chunks(padded) + experts // BLOCK) + 12 * slots + 4 * experts


def covers(logits, bias, cfg, *, permute: bool = False) -> None:
    """Raise ``ValueError`` for wrong arguments (``kernel.covers``' checks), ``NotImplementedError``
    where ``route`` does not cover them: groups or softmax (``kernel.check_plain_routing``), ``E``
    not a multiple of 32 (of 64 with ``permute``), ``permute`` past ``MAX_PERMUTE_ROWS`` rows."""
    _check(logits, bias, cfg)
    check_plain_routing(cfg)
    if cfg.experts % LANES:
        raise NotImplementedError(
            f"the Mosaic GPU routing kernel holds experts in runs of {LANES} lanes: experts="
            f"{cfg.experts} is not a multiple of {LANES}; use the Triton kernel or backend='xla'")
    if permute:
        _check_permutation(logits.shape[0], cfg)


def _check_permutation(batch: int, cfg: FrontConfig) -> None:
    if cfg.experts % BLOCK:
        raise NotImplementedError(
            f"the Mosaic GPU dispatch order counts experts in blocks of {BLOCK}: experts="
            f"{cfg.experts} is not a multiple of {BLOCK}; use backend='xla'")
    if batch > MAX_PERMUTE_ROWS:
        raise NotImplementedError(
            f"the Mosaic GPU dispatch order covers up to {MAX_PERMUTE_ROWS} rows, got B={batch}; "
            "use backend='xla'")


def covers_permutation(ids, cfg) -> None:
    """``permutation``'s ``covers``: ``ValueError`` for ids that are not ``[B, K]`` int32,
    ``NotImplementedError`` past ``MAX_PERMUTE_ROWS`` rows or for ``E`` not a multiple of 64."""
    _check_ids(ids, cfg)
    _check_permutation(ids.shape[0], cfg)


def _no_barriers():
    """Every thread stores the same values to the same addresses and shared memory is fenced by
    ``_barrier``: Pallas' barriers around each store (two per scalar store) are not needed."""
    return plgpu.CompilerParams(unsafe_no_auto_barriers=True)


def route(logits: jax.Array, bias: jax.Array, cfg: FrontConfig, *, interpret: bool = False,
          permute: bool = False) -> tuple[jax.Array, ...]:
    """Exact top-k routing by sigmoid + correction bias (SPEC section 4), one Mosaic GPU launch.

    Args:
      logits: ``[B, E]`` float32 router logits, ``B >= 1``, ``E`` a multiple of 32.
      bias: ``[E]`` float32 correction bias.
      cfg: supplies ``experts``, ``top_k``, ``routed_scaling_factor`` and ``renormalize``.
      interpret: run in Mosaic GPU's interpret mode (any machine).
      permute: also return the dispatch order of SPEC 4.1 (``permutation``, a second launch).

    Returns ``ids`` ``[B, K]`` int32 and ``weights`` ``[B, K]`` bfloat16, as ``reference.route``;
    with ``permute``, then ``order`` ``[B K]``, ``group_sizes`` ``[E]``, ``inverse`` ``[B K]`` int32.
    Raises ``ValueError`` for wrong shapes or dtypes or an empty batch, ``NotImplementedError``
    where ``covers`` says.
    """
    covers(logits, bias, cfg, permute=permute)
    batch, k = logits.shape[0], cfg.top_k
    ids, weights = plgpu.kernel(
        functools.partial(_route_kernel, cfg=cfg, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((batch, k), jnp.int32),
                  jax.ShapeDtypeStruct((batch, k), jnp.bfloat16)),
        grid=(batch,), grid_names=("row",), compiler_params=_no_barriers(),
        interpret=interpret_params(interpret), kernel_name="route_mosaic",
    )(logits.reshape(batch, -1, LANES), bias.reshape(-1, LANES))
    if not permute:
        return ids, weights
    return (ids, weights, *permutation(ids, cfg, interpret=interpret))


def _permutation(flat, slots: int, cfg: FrontConfig, interpret: bool):
    padded = flat.shape[0]
    kernel = functools.partial(_permute_kernel, slots=slots, padded=padded, interpret=interpret)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((slots,), jnp.int32),
                  jax.ShapeDtypeStruct((cfg.experts,), jnp.int32),
                  jax.ShapeDtypeStruct((slots,), jnp.int32)),
        grid=(_chunks(padded) + cfg.experts // BLOCK,), grid_names=("cta",),
        compiler_params=_no_barriers(), interpret=interpret_params(interpret),
        kernel_name="route_permutation_mosaic",
    )(flat)


def permutation(ids: jax.Array, cfg: FrontConfig, *, interpret: bool = False):
    """The dispatch order of SPEC section 4.1 from given ids ``[B, K]`` int32 (each row's distinct,
    in ``[0, E)``), one Mosaic GPU launch: ``order`` ``[B K]``, ``group_sizes`` ``[E]``,
    ``inverse`` ``[B K]`` int32, as ``reference.routing.permutation``. Below 64 slots the ids are
    padded to 64 first (one XLA op). Raises as ``covers_permutation``."""
    covers_permutation(ids, cfg)
    slots = ids.shape[0] * ids.shape[1]
    flat = ids.reshape(-1)
    if slots < BLOCK:
        flat = jnp.pad(flat, (0, BLOCK - slots), constant_values=cfg.experts)
    return _permutation(flat, slots, cfg, interpret)
