"""Exact top-k routing (SPEC section 4, with the groups of 4.2 and the softmax of 4.3) and the
dispatch order (SPEC 4.1) as Mosaic GPU kernels.

``route``: each warpgroup routes one row of ``logits`` ``[B, E]`` at a time, its four warps each
holding the whole row, ``E / 32`` keys a lane (``ROW``), so that every reduction stays in a warp
(``redux.sync``) and gives every thread the same value: a scalar. ``MosaicRouteConfig`` sets the
rows of a CTA (``warpgroups`` side by side, ``steps`` in turn), whether each warp makes a quarter of
the keys (``split``, through shared memory), each lane's cache, the rounds' loop and where the
weights are made. Keys:
``kernel.ordered_keys``' int32 of ``sigmoid + bias``, or of the logits with softmax. Groups: each
group's two best keys by three masked max reductions, their float32 sum, the ``topk_groups`` best
scores by ``G^2`` scalar comparisons; the other groups' keys go below every key. Selection: ``K``
rounds in a loop; each lane caches its best ``cached`` (key, expert) pairs; a round takes the top by
two one-register max reductions (the key, then the lowest expert holding it, packed with whether
its lane has a key cached behind), writes it to shared memory and moves the winning lane's cache
up; when the winning lane has nothing cached behind, every lane's cache is refilled from its keys
ranked below the one just chosen (a ``lax.cond``), and round 0's refill is the first fill. Why: Mosaic GPU in jax 0.11.2 has
no argmax, sort, cumsum, gather or popcount, but it lowers max reductions over a register layout,
``lax.cond`` on a scalar, scalar loads and stores at any index. Weights: the chosen logits loaded
again, their sigmoids (or ``exp(l - max) / Z``), the tree sum and the correctly rounded division
(``arith.divf``), as ``reference.routing_weights``: on scalars, or with ``lane_weights`` one a
lane (the logits through shared memory, the tree sum a sum over pairs of lanes a level). Softmax's
``Z`` is ``reference.tree_sum`` over the row: five sums over pairs of lanes (``BUTTERFLY``, one
``shfl.bfly`` each: the tree's five lowest levels), then a scalar tree over the ``E / 32`` lane
sums. Bits: ``reference.route``'s in interpret mode, where the kernel's ``exp`` is XLA's (and a
barrier keeps each level of a tree sum apart, as the denominator of each division). On a GPU
``exp`` is Mosaic GPU's ``math.exp`` and the reference's XLA's: where they differ in the last bit,
so do the sigmoids and softmax probabilities, which moves ids only between keys a few ulps apart
and weights by at most one bf16 ulp (SPEC section 4, exactness);
``test_gpu_exp_and_sigmoid_match_xla`` checks.

``permutation``, a second launch (a grid-wide hand-off in one launch needs semaphores, which Mosaic
GPU's interpret mode does not run): slot ``s``'s position is its rank among ``id * S' + s``, each
expert's group size a count; both are ``[64, 64]`` comparisons (the wgmma register layout) summed
over every slot, by one CTA per 64 slots (their ranks, ``inverse``; ``order[inverse[s]] = s`` by
scalar stores) or per 64 experts (the last overlapping the one before). Integers only:
``reference.routing.permutation``'s bits.

Cost: ``kernel.route_bytes`` ``= 4BE + 4E + 10BK`` (7.3 KB at B = 1, 243 KB at 64, K3; softmax
reads no bias, and the row twice, from L1); a row takes ``2K`` dependent one-register warp
reductions, ``2 cached`` passes over its keys per fill, and with groups ``3G`` masked reductions
over the row and ``G^2`` scalar comparisons. ``permute_bytes`` ``= 4S'(S'/64 + E/64) + 12S + 4E`` from L2 (``S =
BK``, ``S' = max(S, 64)``; 7.6 KB at B = 1, 139 KB at 64, 1.3 MB at 256) and ``S'(S' + E)``
comparisons: quadratic in B. Latency-bound; measured in ``benchmarks/bench_route.py`` beside the
Triton kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_front_jax import reference
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.gemm.mosaic import await_inputs, interpret_params
from moe_front_jax.pallas.route.kernel import (
    NAN_KEY, PAD_KEY, _check, _check_ids, next_power_of_2)

LANES = 32
"""Experts a warp's lanes hold side by side: ``route`` needs ``E`` a multiple of it, from two."""
BLOCK = 64
"""Slots or experts a CTA of ``permutation`` owns, and slots it compares them with per step: the
rows and columns of a wgmma-layout ``[64, 64]`` tile. ``permutation`` needs ``E >= 64``."""
MAX_PERMUTE_ROWS = 256
"""Largest batch whose dispatch order ``permutation`` writes: its comparisons grow as ``(B K)^2``."""
MAX_WARPGROUPS, MAX_STEPS, MAX_CACHED, MAX_UNROLL = 4, 64, 8, 64
"""Bounds of ``MosaicRouteConfig``'s fields."""

ROW = plgpu.Layout.TILED(plgpu.Tiling(((1, LANES), (1,))), warp_dims=(plgpu.Replicated(4),),
                         lane_dims=(-2,), vector_dim=-1)
"""A row of ``E`` experts as ``[E / 32, 32]``: expert ``32 j + lane`` in register ``j`` of every
warp's lane ``lane``."""
WARPS = 4
"""Warps of a warpgroup: ``MosaicRouteConfig.split`` gives each a quarter of ``ROW``'s registers."""
SPLIT = plgpu.Layout.TILED(plgpu.Tiling(((WARPS, LANES), (1,))), warp_dims=(-3,), lane_dims=(-2,),
                           vector_dim=-1)
"""``ROW`` over the warps: register ``j`` of ``ROW`` (``E / 32`` a multiple of 4) in warp ``j % 4``
alone."""
BUTTERFLY = plgpu.Layout.TILED(plgpu.Tiling(((1, 2, 2, 2, 2, 2), (1,))),
                               warp_dims=(plgpu.Replicated(4),), lane_dims=(-6, -5, -4, -3, -2),
                               vector_dim=-1)
"""``ROW`` as ``[E / 32, 2, 2, 2, 2, 2]``, the lane's five bits five axes (the last the lowest): a
sum over one of them adds lanes in pairs, one ``shfl.bfly`` (the last: lanes ``2i``, ``2i + 1``)."""
LANE_SUMS = BUTTERFLY.reduce((1, 2, 3, 4, 5))
"""``[E / 32]``: one value per register of ``ROW``, every lane holding them all."""
def weight_layout(k: int):
    """``top_k`` values (a power of two up to 32) one a lane, as ``[2] * log2(k)``, the last axis
    the lowest bit of the rank: a sum over one axis adds them in pairs (one ``shfl.bfly``)."""
    n = k.bit_length() - 1
    spare = (plgpu.Replicated(LANES // k),) if k < LANES else ()
    return plgpu.Layout.TILED(plgpu.Tiling(((2,) * n, (1,))), warp_dims=(plgpu.Replicated(4),),
                              lane_dims=spare + tuple(range(-n - 1, -1)), vector_dim=-1)


EVERY = plgpu.Layout.TILED(plgpu.Tiling(((1,),)), warp_dims=(plgpu.Replicated(4),),
                           lane_dims=(plgpu.Replicated(32),), vector_dim=-1)
"""A short vector (a row's ``top_k`` ids or weights) that every thread holds whole."""
TILE = plgpu.Layout.WGMMA
MINE, THEIRS = TILE.reduce(1), TILE.reduce(0)
"""A ``[64]`` vector along the tile's rows (the CTA's own slots or experts), along its columns (the
slots compared with them)."""


@dataclasses.dataclass(frozen=True)
class MosaicRouteConfig:
    """The schedule of ``route``: the rows a CTA routes and each lane's cache.

    Attributes:
      warpgroups: warpgroups a CTA (1 to ``MAX_WARPGROUPS``), each routing rows of its own.
      steps: rows each warpgroup routes one after another (1 to ``MAX_STEPS``); a CTA routes
        ``warpgroups * steps`` rows (``rows``), the grid ``ceil(B / rows)`` CTAs.
      cached: keys each lane keeps sorted in registers (1 to ``MAX_CACHED``): each costs two passes
        over the lane's keys at every fill; fewer mean more refills (docs/findings.md, Routing).
      split: each warp makes the sigmoid + bias keys of a quarter of the row (``SPLIT``), which
        pass through shared memory to every warp (``E`` a multiple of 128; softmax has none).
      unroll: selection rounds a step of their loop (1 to ``MAX_UNROLL``; ``top_k`` or more: no
        loop), a longer kernel against the loop's branches.
      lane_weights: the weights one a lane (``top_k`` a power of two from 2 to 32), the chosen
        logits through shared memory, rather than every one in every thread.
    """

    IMPLEMENTATION: ClassVar[str] = "mosaic_route"
    warpgroups: int = 1
    steps: int = 1
    cached: int = 3
    split: bool = False
    unroll: int = 1
    lane_weights: bool = False

    def __post_init__(self):
        for name, most in (("warpgroups", MAX_WARPGROUPS), ("steps", MAX_STEPS),
                           ("cached", MAX_CACHED), ("unroll", MAX_UNROLL)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= most:
                raise ValueError(
                    f"MosaicRouteConfig.{name} must be an int from 1 to {most}, got {value!r}")
        for name in ("split", "lane_weights"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(
                    f"MosaicRouteConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def rows(self) -> int:
        """Rows a CTA routes: ``warpgroups * steps``."""
        return self.warpgroups * self.steps

    @property
    def name(self) -> str:
        """Short label, as ``bench_route.py`` prints it: ``w2s1c3u1`` (2 warpgroups, 1 step, 3
        cached, 1 round a step of the loop), ``w1s1c3u1xl`` (split, lane weights)."""
        return (f"w{self.warpgroups}s{self.steps}c{self.cached}u{self.unroll}"
                + ("x" if self.split else "") + ("l" if self.lane_weights else ""))


DEFAULT_CONFIG = MosaicRouteConfig()
"""``route``'s schedule unless told: a warpgroup a row, a CTA a row, 3 keys cached a lane."""


def _barrier() -> None:
    """A warpgroup barrier (shared memory written by some threads, then read by all). Interpret
    mode, where a CTA is one thread, leaves it out (``interpret_params(..., inline_mgpu=False)``)."""
    plgpu.inline_mgpu()(lambda ctx: mgpu.warpgroup_barrier())()


def _div(x, y, interpret: bool):
    """Correctly rounded float32 ``x / y``: ``arith.divf``, ``div.rn.f32``, on the GPU. In interpret
    mode XLA would turn a division into a multiplication by the reciprocal where it can: the
    denominator, at the quotient's shape, goes through a barrier, as in ``reference.routing``."""
    if not interpret:
        return x / y
    x, y = jnp.broadcast_arrays(x, y)
    return x / lax.optimization_barrier(y)


def _sigmoid(x, interpret: bool):
    one = jnp.float32(1)
    return _div(one, one + jnp.exp(-x), interpret)


def _bitcast(x, dtype):
    """``lax.bitcast_convert_type``; a scalar goes through a one-element vector (Pallas' Mosaic GPU
    lowering of jax 0.11.2 makes a scalar's bitcast a zero-rank vector, which it then rejects)."""
    if x.ndim:
        return lax.bitcast_convert_type(x, dtype)
    return jnp.max(lax.bitcast_convert_type(jnp.broadcast_to(x, (1,)), dtype))


def _ordered(key):
    """``kernel.ordered_keys``' int32 image of float32 ``key`` (NaN to ``NAN_KEY``)."""
    bits = _bitcast(key, jnp.int32)
    ordered = jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))
    return jnp.where(key != key, jnp.int32(NAN_KEY), ordered)


def _unordered(ordered):
    """The float32 whose ``_ordered`` image is ``ordered`` (a NaN for ``NAN_KEY``)."""
    return _bitcast(jnp.where(ordered >= 0, ordered, ordered ^ jnp.int32(0x7FFFFFFF)), jnp.float32)


def _tree_sum(values):
    """``((v0+v1)+(v2+v3))+...`` over a list of float32 scalars, padded with zeros to a power of two
    (``reference.tree_sum``)."""
    width = next_power_of_2(len(values))
    values = list(values) + [jnp.float32(0)] * (width - len(values))
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def _pair_sums(x, count: int, interpret: bool):
    """``x`` summed over its last ``count`` axes of two, the last first: each a level of
    ``reference.tree_sum`` (on the GPU one ``shfl.bfly`` where the axis is a lane bit). In interpret
    mode a barrier follows each: XLA would merge the sums into one, which adds in another order."""
    for axis in range(x.ndim - 1, x.ndim - 1 - count, -1):
        x = jnp.sum(x, axis=axis)
        if interpret:
            x = lax.optimization_barrier(x)
    return x


def _row_max(x):
    """The largest of ``ROW`` values ``[E / 32, 32]``: over each lane's registers, then the lanes
    (Mosaic GPU reduces one axis at a time)."""
    return jnp.max(jnp.max(x, axis=0))


def _kept_groups(keys, expert, rev, cfg: FrontConfig):
    """Whether each expert of ``ROW`` keys ``[E / 32, 32]`` lies in one of the ``topk_groups``
    groups with the best scores (SPEC 4.2, ``reference.routing.kept_groups``). Per group, three
    masked max reductions: its best key, the lowest expert holding it, the best key of the others;
    the score, their float32 sum (``reference.routing.group_scores``), ranked by ``G^2`` scalar
    comparisons, ties to the lower group, NaN lowest."""
    pad = jnp.int32(PAD_KEY)
    group = expert // cfg.experts_per_group
    scores = []
    for g in range(cfg.groups):
        mine = group == g
        best = _row_max(jnp.where(mine, keys, pad))
        at = _row_max(jnp.where(mine & (keys == best), rev, -1))
        second = _row_max(jnp.where(mine & (rev != at), keys, pad))
        scores.append(_ordered(_unordered(best) + _unordered(second)))
    kept = group < 0
    for g, score in enumerate(scores):
        beaten = sum(jnp.where((other > score) | ((other == score) & (h < g)), 1, 0)
                     for h, other in enumerate(scores))
        kept = kept | ((group == g) & (beaten < cfg.topk_groups))
    return kept


def _select(keys, rev, chosen_ref, *, cached: int, unroll: int):
    """Write the ``k`` experts with the largest ``ROW`` keys ``[E / 32, 32]`` int32 to
    ``chosen_ref`` ``[k]`` (shared memory, every thread the same values) in rank order, ties to the
    lower expert (``PAD_KEY`` never chosen: at least ``k`` keys above it).
    ``rev``: ``E - 1 - expert``, so that a max finds the lowest expert of a tie. The rounds are a
    loop of ``unroll`` rounds a step; the cache's first fill is the refill of round 0."""
    experts = rev.shape[0] * LANES
    shape = keys.shape
    wide = lambda lane_values: plgpu.layout_cast(
        jnp.broadcast_to(lane_values[None, :], shape), ROW)
    pad = jnp.int32(PAD_KEY)
    live = keys > pad

    def best(valid):
        """Each lane's ``cached`` best keys among ``valid`` and their experts, best first, as
        ``[32]`` vectors, one value a lane (``PAD_KEY`` and -1 where a lane has no more)."""
        cache = []
        for _ in range(cached):
            key = jnp.max(jnp.where(valid, keys, pad), axis=0)
            expert = jnp.max(jnp.where(valid & (keys == wide(key)), rev, -1), axis=0)
            cache += [key, expert]
            valid = valid & (rev != wide(expert))
        return tuple(cache)

    def refill(top, winner, cache):
        """``best`` among the experts ranked below ``(top, winner)``: the ones not chosen yet."""
        del cache
        return best(live & ((keys < top) | ((keys == top) & (rev < winner))))

    def one_round(r, carry):
        cache, top, winner, dry = carry
        cache = lax.cond(dry, refill, lambda top, winner, cache: cache, top, winner, cache)
        top = jnp.max(cache[0])
        # The lowest expert holding the top, times two, plus one where its lane has no key cached
        # behind it: the next round refills.
        flag = jnp.where(cache[2] == pad, 1, 0) if cached > 1 else 1
        mark = jnp.max(jnp.where(cache[0] == top, cache[1] * 2 + flag, -1))
        winner = mark >> 1
        chosen_ref[r] = (experts - 1) - winner
        won = cache[1] == winner
        cache = tuple(jnp.where(won, behind, held) for held, behind in
                      zip(cache, cache[2:] + (pad, jnp.int32(-1))))
        return cache, top, winner, (mark & 1) == 1

    lane = ROW.reduce(0)
    empty = tuple(plgpu.layout_cast(jnp.full((LANES,), value, jnp.int32), lane)
                  for _ in range(cached) for value in (PAD_KEY, -1))
    # Round 0 refills below a key above every key: it fills the cache from every live key.
    first = (empty, jnp.int32(2**31 - 1), jnp.int32(experts), True)
    k = chosen_ref.shape[0]
    unroll = min(unroll, k)

    def rounds(i, carry, count=unroll):
        for j in range(count):
            carry = one_round(i * unroll + j, carry)
        return carry

    carry = lax.fori_loop(0, k // unroll, rounds, first) if k >= 2 * unroll else rounds(0, first)
    if k > unroll and k % unroll:
        rounds(k // unroll, carry, k % unroll)


def _softmax_total(pairs, m, interpret: bool):
    """``reference.tree_sum`` of ``exp(l - m)`` over a row (``BUTTERFLY`` logits ``pairs``; NaN
    as -inf; ``m``, the row's largest logit, NaN as -inf): five sums over pairs of lanes, then the
    ``E / 32`` lane sums (each a masked max, in registers) as a scalar tree."""
    e = _pair_sums(jnp.exp(_finite(pairs) - m), 5, interpret)
    j = plgpu.broadcasted_iota(jnp.int32, e.shape, 0, layout=LANE_SUMS)
    return _tree_sum([jnp.max(jnp.where(j == i, e, -jnp.inf)) for i in range(e.shape[0])])


def _finite(x):
    """NaN as -inf (``reference.softmax_scores``)."""
    return jnp.where(x != x, jnp.float32(-jnp.inf), x)


def _sigmoid_keys(x_ref, bias_ref, keys_ref, *, again: bool, interpret: bool):
    """``ROW`` keys ``[E / 32, 32]`` of ``sigmoid(x) + bias`` (``x_ref``, ``bias_ref`` ``[E / 32,
    32]``). With ``keys_ref`` (shared memory, ``split``) each warp makes a quarter of them
    (``SPLIT``) and every warp loads them all; ``again``: the warpgroup writes them again for
    another row, so it waits until every warp has read them."""
    layout = ROW if keys_ref is None else SPLIT
    x = plgpu.load(x_ref, layout=layout, optimized=False)
    keys = _ordered(_sigmoid(x, interpret) + plgpu.load(bias_ref, layout=layout, optimized=False))
    if keys_ref is None:
        return keys
    keys_ref[...] = keys
    _barrier()
    keys = plgpu.load(keys_ref, layout=ROW, optimized=False)
    if again:
        _barrier()
    return keys


def _route_row(row, logits_ref, second_ref, ids_ref, weights_ref, chosen_ref, keys_ref, lanes_ref,
               *, cfg, config, interpret):
    """Route row ``row``: ``second_ref`` holds the bias ``[E / 32, 32]`` (sigmoid) or the logits as
    ``BUTTERFLY`` pairs ``[B, E / 32, 2, 2, 2, 2, 2]`` (softmax); ``chosen_ref`` ``[K]``, ``keys_ref``
    and ``lanes_ref`` (None unless ``config.split``, ``config.lane_weights``) are the row's shared
    memory for ``_select``, ``_sigmoid_keys`` and the chosen logits one a lane."""
    k, experts = cfg.top_k, cfg.experts
    shape = (experts // LANES, LANES)
    expert = (plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=ROW) * LANES
              + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=ROW))
    # Experts numbered from the top, so that a max reduction finds the lowest expert of a tie.
    rev = (experts - 1) - expert
    softmax = cfg.scoring == "softmax"
    if softmax:
        keys = _ordered(plgpu.load(logits_ref.at[row], layout=ROW, optimized=False))
    else:
        keys = _sigmoid_keys(logits_ref.at[row], second_ref, keys_ref, again=config.steps > 1,
                             interpret=interpret)
        if cfg.topk_groups < cfg.groups:
            keys = jnp.where(_kept_groups(keys, expert, rev, cfg), keys, jnp.int32(PAD_KEY))
    _select(keys, rev, chosen_ref, cached=config.cached, unroll=config.unroll)
    chosen = [chosen_ref[r] for r in range(k)]
    ids_ref[row] = _every(chosen, jnp.int32)
    # The chosen logits again (scalar loads, L1 hits): the scores the keys were made of.
    logits = [logits_ref[row, e // LANES, e % LANES] for e in chosen]
    if softmax:
        pairs = plgpu.load(second_ref.at[row], layout=BUTTERFLY, optimized=False)
        m = _finite(logits[0])  # the top expert's logit: the row's largest
        z = _softmax_total(pairs, m, interpret)
        score = lambda l: _div(jnp.exp(_finite(l) - m), z, interpret)
    else:
        score = lambda l: _sigmoid(l, interpret)
    if lanes_ref is None:
        w = _every(_weights([score(l) for l in logits], _tree_sum, cfg, interpret), jnp.float32)
    else:
        n = k.bit_length() - 1
        for r, logit in enumerate(logits):
            lanes_ref[tuple((r >> (n - 1 - b)) & 1 for b in range(n))] = logit
        lanes = plgpu.load(lanes_ref, layout=weight_layout(k), optimized=False)
        w = _weights(score(lanes), lambda w: _pair_sums(w, n, interpret), cfg, interpret)
    weights_ref[row] = w.astype(jnp.bfloat16)


def _every(values, dtype):
    """``[K]`` (``EVERY``) from ``K`` scalars."""
    slot = plgpu.broadcasted_iota(jnp.int32, (len(values),), 0, layout=EVERY)
    out = jnp.zeros((len(values),), dtype)
    for r, value in enumerate(values):
        out = jnp.where(slot == r, value, out)
    return out


def _weights(scores, tree, cfg: FrontConfig, interpret: bool):
    """``reference.routing_weights`` in float32 from the chosen scores, ``K`` scalars (a list) or
    one a lane (``weight_layout``); ``tree``: their ``reference.tree_sum``."""
    each = (lambda f, w: [f(v) for v in w]) if isinstance(scores, list) else (lambda f, w: f(w))
    w = each(lambda v: jnp.where(v != v, jnp.float32(0), v), scores)
    scale = jnp.float32(cfg.routed_scaling_factor)
    if not cfg.renormalize:
        return each(lambda v: v * scale, w)
    total = tree(w) + jnp.float32(reference.RENORM_EPSILON)
    return each(lambda v: _div(v * scale, total, interpret), w)


def _route_kernel(logits_ref, second_ref, ids_ref, weights_ref, *, chosen_ref, keys_ref=None,
                  lanes_ref=None, cfg, config, batch, interpret):
    await_inputs(interpret)
    first = lax.axis_index("cta") * config.rows
    warpgroup = lax.axis_index("warpgroup") if config.warpgroups > 1 else 0
    route_row = functools.partial(
        _route_row, logits_ref=logits_ref, second_ref=second_ref, ids_ref=ids_ref,
        weights_ref=weights_ref, keys_ref=None if keys_ref is None else keys_ref.at[warpgroup],
        cfg=cfg, config=config, interpret=interpret)

    def step(i):
        row = first + i * config.warpgroups + warpgroup
        # Each step its own ids and logits: a warp may write the next row's while another still
        # reads these.
        rows_refs = dict(chosen_ref=chosen_ref.at[warpgroup, i],
                         lanes_ref=None if lanes_ref is None else lanes_ref.at[warpgroup, i])
        if batch % config.rows:
            pl.when(row < batch)(lambda: route_row(row, **rows_refs))
        else:
            route_row(row, **rows_refs)

    if config.steps == 1:
        step(0)
    else:
        pl.loop(0, config.steps)(step)


def _chunks(total: int):
    """Blocks of 64 over ``total >= 64`` entries, the last one short; the kernel loads it as the
    64 entries ending at ``total`` (overlapping the block before) and counts from ``64 i`` on."""
    return pl.cdiv(total, BLOCK)


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
        # The last block overlaps the one before where E is not a multiple of 64 (``_chunks``).
        first = jnp.minimum((cta - slot_ctas) * BLOCK, sizes_ref.shape[0] - BLOCK)
        expert = first + plgpu.broadcasted_iota(jnp.int32, (BLOCK,), 0, layout=MINE)
        sizes_ref[pl.ds(first, BLOCK)] = count(expert, lambda mine, theirs: theirs == mine,
                                               keyed=False)


def permute_bytes(batch: int, experts: int, top_k: int) -> int:
    """Bytes ``permutation`` moves (L2-resident): every id read once per CTA, its outputs written."""
    slots = batch * top_k
    padded = max(slots, BLOCK)
    return 4 * padded * (_chunks(padded) + _chunks(experts)) + 12 * slots + 4 * experts


def covers(logits, bias, cfg, *, permute: bool = False, config=None) -> None:
    """Raise ``ValueError`` for wrong arguments (``kernel._check``: shapes, dtypes, an empty batch;
    a ``config`` that is not a ``MosaicRouteConfig``), ``NotImplementedError`` where ``route`` does
    not cover them: more than ``kernel.MAX_LANES`` experts (``_check``), ``E`` not a multiple of 32
    or below 64 (Mosaic GPU's layout inference fails on one run of 32), ``split`` with ``E`` not a
    multiple of 128, ``lane_weights`` with ``top_k`` not a power of two up to 32, ``permute`` past
    ``MAX_PERMUTE_ROWS`` rows."""
    _check(logits, bias, cfg)
    if config is not None and not isinstance(config, MosaicRouteConfig):
        raise ValueError(f"config must be a MosaicRouteConfig, got {config!r}")
    config = config or DEFAULT_CONFIG
    if cfg.experts % LANES or cfg.experts < 2 * LANES:
        raise NotImplementedError(
            f"the Mosaic GPU routing kernel holds experts in runs of {LANES} lanes, at least two "
            f"(one does not lower): experts={cfg.experts} is not {LANES} * n with n >= 2; use the "
            "Triton kernel or backend='xla'")
    if config.split and cfg.scoring == "sigmoid" and (
            cfg.experts % (WARPS * LANES)):
        raise NotImplementedError(
            f"MosaicRouteConfig.split gives each of {WARPS} warps a quarter of the row's runs of "
            f"{LANES}: experts={cfg.experts} is not a multiple of {WARPS * LANES}")
    k = cfg.top_k
    if config.lane_weights and (k & (k - 1) or not 2 <= k <= LANES):
        raise NotImplementedError(
            f"MosaicRouteConfig.lane_weights puts a weight in each lane, a power of two of them "
            f"up to {LANES}: top_k={k}")
    if permute:
        _check_permutation(logits.shape[0], cfg)


def _check_permutation(batch: int, cfg: FrontConfig) -> None:
    if cfg.experts < BLOCK:
        raise NotImplementedError(
            f"the Mosaic GPU dispatch order counts experts in blocks of {BLOCK}: experts="
            f"{cfg.experts} is fewer; use backend='xla'")
    if batch > MAX_PERMUTE_ROWS:
        raise NotImplementedError(
            f"the Mosaic GPU dispatch order covers up to {MAX_PERMUTE_ROWS} rows, got B={batch}; "
            "use backend='xla'")


def covers_permutation(ids, cfg) -> None:
    """``permutation``'s ``covers``: ``ValueError`` for ids that are not ``[B, K]`` int32,
    ``NotImplementedError`` past ``MAX_PERMUTE_ROWS`` rows or for fewer than 64 experts."""
    _check_ids(ids, cfg)
    _check_permutation(ids.shape[0], cfg)


def _no_barriers():
    """Every thread stores the same values to the same addresses and shared memory is fenced by
    ``_barrier``: Pallas' barriers around each store (two per scalar store) are not needed."""
    return plgpu.CompilerParams(unsafe_no_auto_barriers=True)


def route(logits: jax.Array, bias: jax.Array, cfg: FrontConfig, *, interpret: bool = False,
          permute: bool = False, config: MosaicRouteConfig | None = None) -> tuple[jax.Array, ...]:
    """Exact top-k routing (SPEC section 4: sigmoid + bias, within the kept groups of 4.2, or the
    softmax of 4.3, as ``cfg`` says), one Mosaic GPU launch.

    Args:
      logits: ``[B, E]`` float32 router logits, ``B >= 1``, ``E`` a multiple of 32 from 64.
      bias: ``[E]`` float32 correction bias (softmax never reads it).
      cfg: supplies the routing fields (``top_k``, groups, ``scoring``, scale, ``renormalize``).
      interpret: run in Mosaic GPU's interpret mode (any machine).
      permute: also return the dispatch order of SPEC 4.1 (``permutation``, a second launch).
      config: the schedule (``MosaicRouteConfig``); None: ``DEFAULT_CONFIG``.

    Returns ``ids`` ``[B, K]`` int32 and ``weights`` ``[B, K]`` bfloat16, as ``reference.route``;
    with ``permute``, then ``order`` ``[B K]``, ``group_sizes`` ``[E]``, ``inverse`` ``[B K]`` int32.
    Raises ``ValueError`` for wrong arguments, ``NotImplementedError`` where ``covers`` says.
    """
    covers(logits, bias, cfg, permute=permute, config=config)
    config = DEFAULT_CONFIG if config is None else config
    batch, k = logits.shape[0], cfg.top_k
    if cfg.scoring == "softmax":
        second = logits.reshape(batch, -1, 2, 2, 2, 2, 2)
    else:
        second = bias.reshape(-1, LANES)
    threads = {}
    if config.warpgroups > 1:
        threads = dict(num_threads=config.warpgroups, thread_name="warpgroup")
    split = config.split and cfg.scoring == "sigmoid"
    rows = (config.warpgroups, config.steps)
    lanes = (2,) * (k.bit_length() - 1)
    scratch = dict(chosen_ref=plgpu.SMEM(rows + (k,), jnp.int32))
    if split:
        scratch["keys_ref"] = plgpu.SMEM((config.warpgroups, cfg.experts // LANES, LANES),
                                         jnp.int32)
    if config.lane_weights:
        scratch["lanes_ref"] = plgpu.SMEM(rows + lanes, jnp.float32)
    weights_shape = (batch, *lanes) if config.lane_weights else (batch, k)
    ids, weights = plgpu.kernel(
        functools.partial(_route_kernel, cfg=cfg, config=config, batch=batch,
                          interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((batch, k), jnp.int32),
                  jax.ShapeDtypeStruct(weights_shape, jnp.bfloat16)),
        grid=(pl.cdiv(batch, config.rows),), grid_names=("cta",), **threads, scratch_types=scratch,
        compiler_params=_no_barriers(), interpret=interpret_params(interpret, inline_mgpu=False),
        kernel_name="route_mosaic",
    )(logits.reshape(batch, -1, LANES), second)
    weights = weights.reshape(batch, k)
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
        grid=(_chunks(padded) + _chunks(cfg.experts),), grid_names=("cta",),
        compiler_params=_no_barriers(), interpret=interpret_params(interpret, inline_mgpu=False),
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
