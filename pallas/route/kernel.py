"""Exact top-k routing as one Pallas Triton kernel (SPEC section 4), with the dispatch order of
SPEC section 4.1 in the same launch.

``route(logits, bias, cfg)``: per row of ``logits`` ``[B, E]`` float32, ``s = sigmoid(logits)``,
``key = s + bias``, ``ids`` the ``top_k`` experts by ``ordered(key)`` (ties to the lower id, NaN
lowest, always ``top_k`` distinct ids), ``weights = bf16((s[ids] * scale) / (tree_sum + 1e-20))``:
``reference.route``'s ids and weight bits. A program holds ``block_rows`` rows in registers, padded to
``lanes`` (the next power of two), keys as order-preserving int32; the ``"argmax"`` selection takes
``top_k`` dependent argmax rounds, ``"groups"`` ranks group maxima (8 reductions for K3 against 16);
the table or the heuristic picks. Triton's ``/`` is approximate: both divisions are ``div.rn.f32``
(``_div``). Why Triton: its ``argmax`` is the (value, index) reduction the selection needs; Mosaic
GPU has no argmax, sort or cumsum in jax 0.11.2.

``permute=True``: a counting sort through a bitmap in global memory (Triton has no sort, register
gather or scatter-add): every program marks its (token, expert) bits and takes a ticket, and the last
one turns the bitmap into ``group_sizes``, ``inverse`` and ``order`` (``mark_tokens``,
``finish_permutation``). Integer arithmetic only: the bits are ``reference.routing.permutation``'s
on any schedule. ``permutation`` runs the same steps over given ids (after ``route_collect``).

Cost (``route_bytes``, ``permute_bytes``): 3.7 KB a K3 row; the order ``16 lanes W + 24BK + 4E + 8``
bytes, L2-resident (``W = ceil(B / 32)``; 20 KB at B = 1, 233 KB at B = 256). Latency-bound: the
floor is a launch, a load and a store; the order adds the workspace's zero fill and the last
program's count and scatter after every ticket (timings: docs/findings.md, Routing).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moe_front_jax import reference
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.device import table_kinds, tuning_entries
from moe_front_jax.pallas.gemm.schedule import config_from_json

MAX_LANES = 4096
"""Widest padded row a program holds in registers (E up to 4096 experts)."""
NAN_KEY = -(2**31) + 1
"""Ordered int32 key of a NaN: below every number (no float maps here)."""
PAD_KEY = -(2**31)
"""Key of a padding lane and of an expert already chosen: below NaN."""
SELECTS = ("argmax", "groups")
"""The selections ``RouteConfig.select`` names: ``select_ranked`` and ``select_grouped``."""
MAX_PERMUTE_ROWS = 1024
"""Largest batch whose dispatch order the kernels write (``covers``): the last program unrolls a
loop over ``ceil(B / 32)`` bitmap columns and ``ceil(B / PERMUTE_CHUNK)`` row chunks."""
PERMUTE_CHUNK = 64
"""Rows of ids the last program turns into ``inverse`` and ``order`` per step (1024 K3 slots: 8
per thread of 4 warps)."""
WAVE_ROWS = 256
"""Rows whose ids and gathers the last program holds at once, so that their loads are in flight
together (4 chunks: 32 values a thread of 4 warps)."""
COLUMNS_HELD = 8
"""Bitmap columns (B <= 256) the last program keeps in registers for the counts and the prefix
(8 words a column a thread of 4 warps); more are loaded twice."""
PERMUTE_BLOCK = 8
"""Rows per program of the standalone ``permutation`` kernel: 128 slots to mark, one atomic a
thread of 4 warps; 64 rows (one CTA marking all 1024 slots of B=64, eight atomics a thread) were
slower (docs/findings.md, Routing)."""


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """Schedule of the routing kernel.

    Attributes:
      block_rows: rows per program, a power of two.
      num_warps: Triton warps per program, a power of two.
      select: ``"argmax"`` (``select_ranked``: ``top_k`` dependent argmax rounds) or ``"groups"``
        (``select_grouped``: group maxima ranked pairwise, the best groups gathered and narrowed
        again; a fixed handful of reductions whatever ``top_k``).
      group: lanes per level-1 group of ``"groups"``, a power of two; 0 (the default) picks
        ``group_plan``'s size. Unused by argmax.
      width: lanes per run of the candidates ``"groups"`` ranks last (``group_plan``), a power of
        two; 0 (the default) is 4. Unused by argmax.
    """

    IMPLEMENTATION: ClassVar[str] = "triton_route"
    block_rows: int
    num_warps: int
    select: str = "argmax"
    group: int = 0
    width: int = 0

    def __post_init__(self):
        for name in ("block_rows", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"RouteConfig.{name} must be a power of two >= 1, got {value!r}")
        if self.select not in SELECTS:
            raise ValueError(f"RouteConfig.select must be one of {SELECTS}, got {self.select!r}")
        for name in ("group", "width"):
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool) or value < 0
                    or value & (value - 1)):
                raise ValueError(f"RouteConfig.{name} must be 0 or a power of two, got {value!r}")

    @property
    def name(self) -> str:
        """Short label, as the benchmark sweep prints it: ``r1w4`` (argmax), ``r1w4g`` (groups,
        ``group_plan``'s sizes), ``r1w4g8`` (groups of 8 lanes), ``r1w4g8x8`` (and runs of 8)."""
        tail = ""
        if self.select == "groups":
            tail = "g" + (str(self.group) if self.group else "")
            tail += f"x{self.width}" if self.width else ""
        return f"r{self.block_rows}w{self.num_warps}{tail}"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def table_key(experts: int, top_k: int) -> str:
    """Key of a ``route.json`` entry."""
    return f"experts={experts},top_k={top_k}"


@functools.cache
def load_table(kind: str) -> dict[str, tuple[tuple[int, RouteConfig], ...]]:
    """Device ``kind``'s schedule table, ``pallas/tuning/<kind_folder(kind)>/route.json``:
    ``table_key`` -> ``((largest batch, config), ...)`` by increasing batch; empty where the kind
    has none."""
    return {
        key: tuple(sorted(((s["max_batch"], config_from_json(s["config"], (RouteConfig,)))
                           for s in entry["schedules"]), key=lambda item: item[0]))
        for key, entry in tuning_entries(kind, "route").items()
    }


def heuristic_config(batch: int, experts: int, top_k: int) -> RouteConfig:
    """One row per program (decode batches never fill the SMs twice over), a warp per 256 lanes
    (between 1 and 8), and the groups selection (faster than argmax at every batch swept,
    docs/findings.md; the kernel runs argmax where ``group_plan`` has no plan)."""
    del batch, top_k
    return RouteConfig(1, max(1, min(8, next_power_of_2(experts) // 256)), "groups")


def pick_config(batch: int, experts: int, top_k: int) -> RouteConfig:
    """The device's table entry for this shape (its own table's, else the one it borrows,
    ``device.TABLES_OF``), else ``heuristic_config``."""
    for kind in table_kinds():
        for limit, config in load_table(kind).get(table_key(experts, top_k), []):
            if batch <= limit:
                return config
    return heuristic_config(batch, experts, top_k)


def route_bytes(batch: int, experts: int, top_k: int, *, bias: bool = True) -> int:
    """Bytes one call moves (the docstring's count): logits, the bias (where read), the chosen
    logits again, ids and weights."""
    return 4 * batch * experts + 4 * experts * bias + 4 * batch * top_k + 6 * batch * top_k


def permute_words(batch: int) -> int:
    """Bitmap columns of the dispatch order: one 32-bit word per expert for each 32 tokens."""
    return -(-batch // 32)


def permute_bytes(batch: int, experts: int, top_k: int) -> int:
    """Bytes the dispatch order adds to a call (the module docstring's count, all L2-resident)."""
    lanes = next_power_of_2(experts)
    return 16 * lanes * permute_words(batch) + 24 * batch * top_k + 4 * experts + 8


def workspace_shape(batch: int, lanes: int) -> tuple[int]:
    """The zeroed int32 workspace of the order: the bitmap ``[W, lanes]`` (flat, column ``w`` at
    ``w * lanes``), the ticket word, a junk word that the masked lanes of the marks go to."""
    return (lanes * permute_words(batch) + 2,)


def _ticket_word(batch: int, lanes: int) -> int:
    return lanes * permute_words(batch)


def mark_tokens(ws_ref, ids, rows, ok, *, lanes: int, interpret: bool) -> None:
    """Set bit ``t % 32`` of bitmap word ``(t // 32, e)`` for each chosen expert ``e`` of each token
    ``t`` of ``rows`` ``[rows, 1]`` int32 (``ids`` ``[rows, slots]``, ``ok`` the same shape:
    padding rows and slots False). Masked lanes go to the junk word with 0: Pallas' interpret mode
    has no masked atomics.

    On the GPU one vector ``atomic_or``. (Not an add: Pallas lowers an integer atomic add of a
    tensor as ``fadd``, seen in the Triton IR of jax 0.11.2.) Interpret mode has no atomic or, and
    its vector atomic is a scatter that keeps one of repeated addresses (two rows of a word choosing
    the same expert): there, one ``atomic_add`` per row, which equals the or as the bits are
    distinct (a token holds an expert once)."""
    junk = ws_ref.shape[0] - 1  # the workspace's last word
    index = jnp.where(ok, (rows >> 5) * lanes + ids, junk)
    value = jnp.where(ok, jnp.left_shift(jnp.int32(1), rows & 31), jnp.int32(0))
    if interpret:
        for r in range(ids.shape[0]):
            plgpu.atomic_add(ws_ref, index[r], value[r])
    else:
        plgpu.atomic_or(ws_ref, index, value)


def finish_permutation(ids_ref, ws_ref, prefix_ref, order_ref, sizes_ref, inverse_ref, *,
                       batch: int, experts: int, lanes: int, k: int, slots: int,
                       interpret: bool) -> None:
    """The order's last steps, by the one program that drew the last ticket: from the bitmap in
    ``ws_ref`` and the ids in ``ids_ref`` ``[B, K]``, write ``sizes_ref`` ``[E]``, ``prefix_ref``
    ``[W * lanes]`` (scratch), ``inverse_ref`` ``[B, K]`` and ``order_ref`` ``[B * K]``."""
    # Before: each program stored its ids, marked its tokens (``mark_tokens``), then took a ticket (a
    # CTA barrier and an acquire-release atomic add, as ``gemm.triton.finish_split_k`` hands a tile to
    # its last program; none with one program). Here: popcounts of the bitmap's ``W = ceil(B / 32)``
    # columns of ``lanes`` words give ``group_sizes``; an exclusive cumsum over experts gives each
    # expert's start; each column's running start (``prefix[w, e]``: the start of ``e`` plus its slots
    # of tokens below ``32 w``) goes to scratch, then a CTA barrier. Then, in chunks of
    # ``PERMUTE_CHUNK`` rows, slot ``s = t K + r`` of expert ``e`` gets ``inverse[s] = prefix[t // 32,
    # e] + popcount(word(t // 32, e) & ((1 << t % 32) - 1))`` and ``order[inverse[s]] = s``.
    #
    # The plain loads see every program's writes after the ticket's acquire: no line of the bitmap
    # (touched only by atomics, at L2) or of the ids (only stored) can sit in this SM's L1 before it
    # reads them (Pallas' ``.cg`` cache modifier does not lower in jax 0.11.2). Latency: one CTA's L2
    # round trips after the slowest ticket, each step's loads issued together: the columns and the
    # first ``WAVE_ROWS`` rows of ids, the prefix and the barrier, the gathers, the stores (4 steps
    # for B <= 256, 2 more for each further 256 rows); timings: docs/findings.md, Routing.
    words = permute_words(batch)
    lane = lax.broadcasted_iota(jnp.int32, (lanes,), 0)
    chunk = min(PERMUTE_CHUNK, next_power_of_2(batch))
    slot = lax.broadcasted_iota(jnp.int32, (1, slots), 1)
    firsts = list(range(0, batch, chunk))
    per_wave = max(1, WAVE_ROWS // chunk)
    waves = [firsts[i:i + per_wave] for i in range(0, len(firsts), per_wave)]

    def load_ids(first):
        rows = first + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
        ok = (rows < batch) & (slot < k)
        mask = None if first + chunk <= batch and slots == k else ok
        # A traced start: a static one past the end fails the indexer's bounds check.
        ids = plgpu.load(ids_ref.at[pl.ds(jnp.int32(first), chunk), pl.ds(0, slots)], mask=mask,
                         other=None if mask is None else 0)
        return first, rows, ok, mask, ids

    def column(w):
        return plgpu.load(ws_ref.at[pl.ds(w * lanes, lanes)])

    first_ids = [load_ids(first) for first in waves[0]]  # in flight beside the columns' loads
    held = [column(w) for w in range(words)] if words <= COLUMNS_HELD else None
    col = (lambda w: held[w]) if held is not None else column
    counts = lax.population_count(col(0))
    for w in range(1, words):
        counts = counts + lax.population_count(col(w))
    plgpu.store(sizes_ref.at[pl.ds(0, lanes)], counts,
                mask=None if lanes == experts else lane < experts)
    running = jnp.cumsum(counts) - counts  # each expert's start: the exclusive prefix
    for w in range(words):
        plgpu.store(prefix_ref.at[pl.ds(w * lanes, lanes)], running)
        if w + 1 < words:
            running = running + lax.population_count(col(w))
    if not interpret:  # interpret mode runs programs one at a time (and has no barrier rule)
        plgpu.debug_barrier()  # the prefix, stored by every thread, before any thread gathers it
    for n, wave in enumerate(waves):
        loaded = first_ids if n == 0 else [load_ids(first) for first in wave]
        gathered = []
        for first, rows, ok, mask, ids in loaded:
            at = (rows >> 5) * lanes + ids
            if mask is not None:
                at = jnp.where(ok, at, 0)
            start = plgpu.load(prefix_ref.at[at], mask=mask, other=None if mask is None else 0)
            word = plgpu.load(ws_ref.at[at], mask=mask, other=None if mask is None else 0)
            gathered.append((first, rows, ok, mask, start, word))
        for first, rows, ok, mask, start, word in gathered:
            below = word & (jnp.left_shift(jnp.int32(1), rows & 31) - 1)  # tokens below t
            inverse = start + lax.population_count(below)
            plgpu.store(inverse_ref.at[pl.ds(jnp.int32(first), chunk), pl.ds(0, slots)], inverse,
                        mask=mask)
            target = inverse if mask is None else jnp.where(ok, inverse, batch * k)  # past the end
            plgpu.store(order_ref.at[target], rows * k + slot, mask=mask)


def arrive(ws_ref, *, batch: int, lanes: int, programs: int, interpret: bool, finish) -> None:
    """Step 1's hand-off: after a CTA barrier (this program's ids and atomic ors before its
    ticket), an acquire-release ticket; the program that draws ``programs - 1`` runs ``finish()``.
    One program finishes at once, after the barrier alone."""
    if not interpret:
        plgpu.debug_barrier()
    if programs == 1:
        finish()
        return
    ticket = plgpu.atomic_add(ws_ref, jnp.int32(_ticket_word(batch, lanes)), jnp.int32(1))

    @pl.when(ticket == programs - 1)
    def _():
        finish()


def _div(x, y, interpret: bool):
    """Correctly rounded float32 ``x / y`` (Triton's own ``/`` is approximate on the GPU).

    In interpret mode the body runs as XLA, whose simplifier turns a division by a broadcast into a
    multiplication by the reciprocal, which rounds differently: the full-shape denominator goes
    through ``lax.optimization_barrier``, as in ``reference.routing``."""
    x, y = jnp.broadcast_arrays(x, y)
    if interpret:
        return x / lax.optimization_barrier(y)
    [out] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, y],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return out


def _sigmoid(x, interpret: bool):
    one = jnp.float32(1)
    return _div(one, one + jnp.exp(-x), interpret)


def _tree_sum(w, interpret: bool):
    """Pairwise sum over the last axis (a power of two): ``((w0+w1)+(w2+w3))+...``, keeping it as a
    size-1 axis. In interpret mode a barrier follows each level: XLA would merge the chained
    reductions into one sequential sum, which rounds differently."""
    while w.shape[-1] > 1:
        w = jnp.sum(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), axis=-1)
        if interpret:
            w = lax.optimization_barrier(w)
    return w


def ordered_keys(x, b, lane_ok, interpret: bool):
    """``[rows, lanes]`` float32 logits and ``[lanes]`` bias to order-preserving int32 keys of
    ``sigmoid(x) + b`` (NaN to ``NAN_KEY``; lanes where ``lane_ok`` ``[1, lanes]`` is False, if given,
    to ``PAD_KEY``). Any shape ``x`` with ``b`` and ``lane_ok`` of its rank works too (gathered
    lanes): the keys are elementwise, so a lane's key is the same bits however it is loaded."""
    key = _sigmoid(x, interpret) + (b if b.ndim == x.ndim else b[None, :])
    bits = lax.bitcast_convert_type(key, jnp.int32)
    ordered = jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))
    ordered = jnp.where(key != key, jnp.int32(NAN_KEY), ordered)
    if lane_ok is not None:
        ordered = jnp.where(lane_ok, ordered, jnp.int32(PAD_KEY))
    return ordered


def select_ranked(ordered, lane, slot, k: int):
    """The lanes of the ``k`` largest keys of each row, ``[rows, slots]`` int32 (slot ``r < k``: rank
    ``r``, ties to the lower lane; slots past ``k`` hold 0): ``k`` unrolled argmax rounds.

    Args:
      ordered: ``[rows, lanes]`` int32 keys (``ordered_keys``), at least ``k`` above ``PAD_KEY``.
      lane: ``[1, lanes]`` iota; slot: ``[1, slots]`` iota, ``slots >= k``.
    """
    ids = jnp.zeros((ordered.shape[0], slot.shape[1]), jnp.int32)
    for r in range(k):
        best = jnp.argmax(ordered, axis=1).astype(jnp.int32)[:, None]  # ties: the lower lane
        ids = jnp.where(slot == r, best, ids)
        if r + 1 < k:
            ordered = jnp.where(lane == best, jnp.int32(PAD_KEY), ordered)
    return ids


def group_plan(lanes: int, experts: int, k: int, group: int = 0, width: int = 0):
    """The widths ``select_grouped`` narrows through, ``(S, W1, ..., Wn)``, or None.

    Level-1 groups of ``S`` lanes (``group``, else ``lanes // (4 * slots)`` with ``slots =
    next_power_of_2(k)``: ``4 * slots`` groups); then, while wider than ``width`` (0: 4), runs a
    quarter as wide, or ``width`` wide if that is more. The K3 row (1024 lanes, 16 slots) gives
    ``(16, 4)``; ``group=8`` gives ``(8, 4)``, and with ``width=8`` just ``(8,)``. None where the
    groups cannot work: fewer than ``slots`` groups (each rank below ``slots`` needs a group of its
    own), fewer than ``k`` groups holding an expert, or a group wider than the row; the kernel then
    uses argmax (``select_ranked``)."""
    slots = next_power_of_2(k)
    size = group or max(1, lanes // (4 * slots))
    width = width or 4
    if size > lanes or lanes // size < slots or -(-experts // size) < k:
        return None
    widths = [size]
    while widths[-1] > width:
        widths.append(max(widths[-1] // 4, width))
    return tuple(widths)


def group_widths(config: RouteConfig, experts: int, top_k: int) -> tuple[int, ...] | None:
    """``group_plan``'s widths for ``config`` (None: the kernel selects by argmax)."""
    if config.select != "groups":
        return None
    return group_plan(next_power_of_2(experts), experts, top_k, config.group, config.width)


def _ranks(key, first):
    """Rank of each of ``N`` items, ``[rows, N]`` int32: how many items beat it, one item beating
    another with a larger key, or an equal key and a lower ``first`` lane (``[rows or 1, N]``,
    distinct). A ``[rows, N, N]`` comparison summed; the ranks are a permutation of ``0 .. N-1``."""
    beats = (key[:, None, :] > key[:, :, None]) | (
        (key[:, None, :] == key[:, :, None]) & (first[:, None, :] < first[:, :, None])
    )
    return jnp.sum(beats.astype(jnp.int32), axis=2)


def _by_rank(rank, value, n: int):
    """Entry ``r < n`` of the result ``[rows, n]``: the ``value`` (``[rows or 1, N]``) of the item
    whose ``rank`` (``[rows, N]``, a permutation) is ``r``. A ``[rows, N, n]`` masked sum over
    ``N``, exactly one term nonzero."""
    r = lax.broadcasted_iota(jnp.int32, (1, 1, n), 2)
    return jnp.sum(jnp.where(rank[:, :, None] == r, value[:, :, None], 0), axis=1)


def select_grouped(ordered, lane, slot, k: int, keys_at, widths: tuple[int, ...]):
    """``select_ranked``'s result (the lanes of the ``k`` largest keys of each row in rank order,
    ties to the lower lane; slots past ``k`` hold 0), exactly, by narrowing through groups: a fixed
    number of reductions, none of them repeated ``k`` times.

    Args:
      ordered: ``[rows, lanes]`` int32 keys (``ordered_keys``), at least ``k`` above ``PAD_KEY``.
      lane: ``[1, lanes]`` iota (unused; ``select_ranked``'s signature); slot: ``[1, slots]`` iota,
        ``slots = next_power_of_2(k)``.
      keys_at: int32 lanes ``[rows, a, b]`` to their keys ``[rows, a, b]``: the bits ``ordered``
        holds at those lanes (``PAD_KEY`` past the experts).
      widths: ``group_plan(lanes, experts, k, ...)``, not None.
    """
    # 1. The row as ``G = lanes / S`` groups of ``S`` consecutive lanes: each group's max key (a max
    #    reduction), the groups ranked by a ``[G, G]`` comparison summed (max descending, the lower
    #    group first on equal maxima), and the first lanes of the ``slots`` best groups in rank order
    #    (a ``[G, slots]`` masked sum). The top ``k`` lanes all lie in the ``k`` best groups: if ``x``
    #    of the top ``k`` sat in a group ranked ``k`` or lower, each of the ``k`` groups ranked above
    #    would hold a lane beating ``x``, its max (a larger key, or an equal one at a lower lane, as
    #    groups are disjoint runs of lanes and equal maxima go to the lower group).
    # 2. Those groups' lanes, ``[rows, slots, S]``, keyed by ``keys_at`` (the kernel loads their
    #    logits and bias again and keys them with ``ordered_keys``: the bits ``ordered`` holds).
    # 3. For each further width ``W'`` of ``widths``, step 1 within the candidates: each candidate
    #    group cut in runs of ``W'`` lanes, the ``slots * W / W'`` run maxima ranked (ties to the
    #    lower first lane: the runs are disjoint runs of lanes too), the first lanes of the ``slots``
    #    best in rank order, and their ``[rows, slots, W']`` keys from ``keys_at`` again. The
    #    candidates still hold the top ``k``, by the same argument.
    # 4. The ``C = slots * W`` candidates ranked by key, then lane (``[C, C]``); the ids by rank (a
    #    ``[C, slots]`` masked sum).
    #
    # With ``S = 1`` step 1 ranks the lanes themselves and gives the ids. Each level loads its keys
    # again rather than moving the previous level's by a masked sum: compiled for sm_90, such moves
    # (``[slots, 4 * slots, W']`` tensors) were replicated across threads by Triton's layouts, up to
    # hundreds of registers a thread and spills with ``S = 32``.
    del lane
    rows, lanes = ordered.shape
    slots = slot.shape[1]
    size = widths[0]
    groups = lanes // size
    assert groups >= slots >= k, (lanes, widths, k, slots)

    def runs(start, count, step=1):
        """``[rows, n, count]``: ``start`` ``[rows, n]`` plus ``0, step, ..., (count-1) * step``."""
        return start[:, :, None] + lax.broadcasted_iota(jnp.int32, (1, 1, count), 2) * step

    # Level 1: group maxima, ranked; the first lanes of the best ``slots`` groups, in rank order.
    gmax = jnp.max(ordered.reshape(rows, groups, size), axis=2) if size > 1 else ordered
    first = lax.broadcasted_iota(jnp.int32, (1, groups), 1) * size
    start = _by_rank(_ranks(gmax, first), first, slots)  # [rows, slots]
    if size == 1:
        ids = start  # the lanes themselves, ranked
    else:
        width = size
        for sub in widths[1:]:
            # Runs of ``sub`` lanes, ``slots * width / sub`` of them, ranked by their maxima.
            keys = keys_at(runs(start, width)).reshape(rows, -1, sub)
            first = runs(start, width // sub, sub).reshape(rows, -1)
            start = _by_rank(_ranks(jnp.max(keys, axis=2), first), first, slots)
            width = sub
        # The ``slots * width`` candidates, ranked among themselves.
        lanes_c = runs(start, width).reshape(rows, -1)
        keys = keys_at(runs(start, width)).reshape(rows, -1)
        ids = _by_rank(_ranks(keys, lanes_c), lanes_c, slots)
    if slots != k:
        ids = jnp.where(slot < k, ids, 0)
    return ids


def routing_weights(chosen, slot, cfg: FrontConfig, interpret: bool):
    """The chosen experts' logits ``[rows, slots]`` float32 (slots past ``cfg.top_k`` ignored) to
    their bfloat16 routing weights (SPEC section 4: NaN sigmoids weigh 0, the tree-sum renormalize)."""
    w = _sigmoid(chosen, interpret)
    w = jnp.where(w != w, jnp.float32(0), w)
    if slot.shape[1] != cfg.top_k:
        w = jnp.where(slot < cfg.top_k, w, jnp.float32(0))
    scaled = w * jnp.float32(cfg.routed_scaling_factor)
    if cfg.renormalize:
        total = _tree_sum(w, interpret) + jnp.float32(reference.RENORM_EPSILON)
        scaled = _div(scaled, jnp.broadcast_to(total, scaled.shape), interpret)
    return scaled.astype(jnp.bfloat16)


def _kernel(logits_ref, bias_ref, *refs, batch, experts, lanes, slots, cfg, block_rows, widths,
            permute, interpret):
    if permute:  # the workspace is an input aliased to an output: use the output
        _, ids_ref, weights_ref, order_ref, sizes_ref, inverse_ref, ws_ref, prefix_ref = refs
    else:
        ids_ref, weights_ref = refs
    bb, k = block_rows, cfg.top_k
    first = pl.program_id(0) * bb
    rows = first + lax.broadcasted_iota(jnp.int32, (bb, 1), 0)
    lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
    row_ok = rows < batch
    lane_ok = lane < experts
    lane_mask = lane_ok if lanes != experts else None
    row_mask = row_ok if batch % bb else None
    if lane_mask is None and row_mask is None:
        mask = None
    elif lane_mask is None:
        mask = row_mask
    elif row_mask is None:
        mask = lane_mask
    else:
        mask = row_mask & lane_mask
    x = plgpu.load(
        logits_ref.at[pl.ds(first, bb), pl.ds(0, lanes)],
        mask=mask,
        other=None if mask is None else 0.0,
    )
    b = plgpu.load(
        bias_ref.at[pl.ds(0, lanes)],
        mask=None if lane_mask is None else lane_ok[0],
        other=None if lane_mask is None else 0.0,
    )
    ordered = ordered_keys(x, b, lane_ok if lane_mask is not None else None, interpret)
    slot = lax.broadcasted_iota(jnp.int32, (1, slots), 1)
    if widths is None:
        ids = select_ranked(ordered, lane, slot, k)
    else:

        def keys_at(at):
            """Keys of lanes ``at`` ``[bb, a, b]``: logits and bias gathered again (L1/L2 hits)."""
            ok = at < experts if lane_mask is not None else None
            load_ok = ok
            if row_mask is not None:
                load_ok = row_mask[:, :, None] if ok is None else ok & row_mask[:, :, None]
            at_rows = jnp.broadcast_to(rows[:, :, None], at.shape)
            xg = plgpu.load(
                logits_ref.at[at_rows, at],
                mask=load_ok,
                other=None if load_ok is None else 0.0,
            )
            bg = plgpu.load(bias_ref.at[at], mask=ok, other=None if ok is None else 0.0)
            return ordered_keys(xg, bg, ok, interpret)

        ids = select_grouped(ordered, lane, slot, k, keys_at, widths)
    slot_ok = slot < k
    out_mask = slot_ok if slots != k else None
    if row_mask is not None:
        out_mask = row_mask if out_mask is None else row_mask & out_mask
    # The chosen experts' logits, gathered back; their sigmoids are the ones the keys were made of.
    gather_rows = jnp.broadcast_to(rows, (bb, slots))
    chosen = plgpu.load(
        logits_ref.at[gather_rows, ids],
        mask=out_mask,
        other=None if out_mask is None else 0.0,
    )
    scaled = routing_weights(chosen, slot, cfg, interpret)
    plgpu.store(ids_ref.at[pl.ds(first, bb), pl.ds(0, slots)], ids, mask=out_mask)
    plgpu.store(weights_ref.at[pl.ds(first, bb), pl.ds(0, slots)], scaled, mask=out_mask)
    if permute:
        mark_tokens(ws_ref, ids, rows, row_ok & (slot < k), lanes=lanes, interpret=interpret)
        arrive(ws_ref, batch=batch, lanes=lanes, programs=pl.cdiv(batch, bb), interpret=interpret,
               finish=functools.partial(
                   finish_permutation, ids_ref, ws_ref, prefix_ref, order_ref, sizes_ref,
                   inverse_ref, batch=batch, experts=experts, lanes=lanes, k=k, slots=slots,
                   interpret=interpret))


def _check(logits, bias, cfg) -> None:
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] != cfg.experts or logits.dtype != jnp.float32:
        raise ValueError(
            f"logits must be [B, experts={cfg.experts}] float32, got {shape} "
            f"{getattr(logits, 'dtype', None)}"
        )
    if shape[0] == 0:
        raise ValueError(f"logits is an empty batch (shape {tuple(shape)}); B must be >= 1")
    bias_shape = getattr(bias, "shape", None)
    if bias_shape is None or tuple(bias_shape) != (cfg.experts,) or bias.dtype != jnp.float32:
        raise ValueError(
            f"bias must be ({cfg.experts},) float32, got {bias_shape} {getattr(bias, 'dtype', None)}"
        )
    if next_power_of_2(cfg.experts) > MAX_LANES:
        raise NotImplementedError(
            f"the routing kernel holds up to {MAX_LANES} experts a row, got experts={cfg.experts}; use "
            "backend='xla'"
        )


def _check_permute_rows(batch: int) -> None:
    if batch > MAX_PERMUTE_ROWS:
        raise NotImplementedError(
            f"the routing kernels write the dispatch order of up to {MAX_PERMUTE_ROWS} rows, got "
            f"B={batch}; use backend='xla'")


def check_plain_routing(cfg: FrontConfig) -> None:
    """Raise ``NotImplementedError`` for routing beyond SPEC section 4's steps: expert groups that
    drop some (4.2) or softmax scoring (4.3), which the kernel does not rank."""
    if cfg.scoring != "sigmoid" or cfg.topk_groups < cfg.groups:
        raise NotImplementedError(
            f"the routing kernel ranks sigmoid + bias over all experts; scoring={cfg.scoring!r} "
            f"with groups={cfg.groups}, topk_groups={cfg.topk_groups} runs the reference")


def covers(logits, bias, cfg, *, permute: bool = False) -> None:
    """Raise ``NotImplementedError`` where the kernel does not cover these arguments (more than
    ``MAX_LANES`` experts; groups or softmax, ``check_plain_routing``; with ``permute``, more than
    ``MAX_PERMUTE_ROWS`` rows), ``ValueError`` where they are wrong."""
    _check(logits, bias, cfg)
    check_plain_routing(cfg)
    if permute:
        _check_permute_rows(logits.shape[0])


def _permutation_outputs(batch: int, k: int, experts: int, lanes: int):
    """Output shapes after ids (and weights): order, group sizes, inverse ``[B, K]`` (reshaped by
    the caller), the workspace, the prefix scratch."""
    return [
        jax.ShapeDtypeStruct((batch * k,), jnp.int32),
        jax.ShapeDtypeStruct((experts,), jnp.int32),
        jax.ShapeDtypeStruct((batch, k), jnp.int32),
        jax.ShapeDtypeStruct(workspace_shape(batch, lanes), jnp.int32),
        jax.ShapeDtypeStruct((lanes * permute_words(batch),), jnp.int32),
    ]


def route(
    logits: jax.Array,
    bias: jax.Array,
    cfg: FrontConfig,
    *,
    interpret: bool = False,
    config: RouteConfig | None = None,
    permute: bool = False,
) -> tuple[jax.Array, ...]:
    """Exact top-k routing by sigmoid + correction bias (SPEC section 4), one Pallas kernel.

    ``logits`` ``[B, E]`` float32 (``B >= 1``), ``bias`` ``[E]`` float32; ``cfg`` supplies
    ``experts``, ``top_k``, ``routed_scaling_factor`` and ``renormalize``; ``config`` None picks
    the device's table entry or the heuristic; ``permute`` (static) also writes the dispatch order
    of SPEC section 4.1 in the same launch; ``interpret``: Pallas' interpret mode (any machine).

    Returns ``ids`` ``[B, K]`` int32 (rank 0 the largest key, ties to the lower id, NaN keys lowest;
    always ``K`` distinct ids in ``[0, E)``) and ``weights`` ``[B, K]`` bfloat16, as
    ``reference.route``; with ``permute``, then ``order`` ``[B * K]``, ``group_sizes`` ``[E]`` and
    ``inverse`` ``[B * K]`` int32, as ``reference.routing.permutation``.

    Raises ValueError for wrong shapes or dtypes or an empty batch, NotImplementedError for more
    than 4096 experts, groups that drop some or softmax scoring (``check_plain_routing``), or
    ``permute`` over ``MAX_PERMUTE_ROWS`` rows (use ``backend='xla'``).
    """
    covers(logits, bias, cfg, permute=permute)
    batch, experts = logits.shape
    config = config or pick_config(batch, experts, cfg.top_k)
    if not isinstance(config, RouteConfig):
        raise ValueError(f"config must be a RouteConfig or None, got {type(config).__name__}")
    block_rows = min(config.block_rows, next_power_of_2(batch))
    lanes = next_power_of_2(experts)
    widths = group_widths(config, experts, cfg.top_k)
    kernel = functools.partial(
        _kernel,
        batch=batch,
        experts=experts,
        lanes=lanes,
        slots=next_power_of_2(cfg.top_k),
        cfg=cfg,
        block_rows=block_rows,
        widths=widths,
        permute=permute,
        interpret=interpret,
    )
    out_shape = [
        jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.int32),
        jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.bfloat16),
    ]
    inputs, aliases = (logits, bias), {}
    if permute:
        out_shape += _permutation_outputs(batch, cfg.top_k, experts, lanes)
        inputs += (jnp.zeros(workspace_shape(batch, lanes), jnp.int32),)
        aliases = {2: 5}
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(batch, block_rows),),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="route",
    )(*inputs)
    if not permute:
        return tuple(outs)
    ids, weights, order, sizes, inverse, _, _ = outs
    return ids, weights, order, sizes, inverse.reshape(-1)


def _check_ids(ids, cfg) -> None:
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    shape = getattr(ids, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] != cfg.top_k or ids.dtype != jnp.int32:
        raise ValueError(
            f"ids must be [B, top_k={cfg.top_k}] int32, got {shape} {getattr(ids, 'dtype', None)}")
    if shape[0] == 0:
        raise ValueError(f"ids is an empty batch (shape {tuple(shape)}); B must be >= 1")


def covers_permutation(ids, cfg) -> None:
    """``permutation``'s ``covers``: ``NotImplementedError`` past ``MAX_LANES`` experts or
    ``MAX_PERMUTE_ROWS`` rows, ``ValueError`` for ids that are not ``[B, K]`` int32."""
    _check_ids(ids, cfg)
    if next_power_of_2(cfg.experts) > MAX_LANES:
        raise NotImplementedError(
            f"the permutation kernel holds up to {MAX_LANES} experts, got experts={cfg.experts}; "
            "use backend='xla'")
    _check_permute_rows(ids.shape[0])


def _permute_kernel(ids_ref, _, order_ref, sizes_ref, inverse_ref, ws_ref, prefix_ref, *, batch,
                    experts, lanes, k, slots, block, interpret):
    first = pl.program_id(0) * block
    rows = first + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    slot = lax.broadcasted_iota(jnp.int32, (1, slots), 1)
    ok = (rows < batch) & (slot < k)
    mask = None if batch % block == 0 and slots == k else ok
    ids = plgpu.load(ids_ref.at[pl.ds(first, block), pl.ds(0, slots)], mask=mask,
                     other=None if mask is None else 0)
    mark_tokens(ws_ref, ids, rows, ok, lanes=lanes, interpret=interpret)
    arrive(ws_ref, batch=batch, lanes=lanes, programs=pl.cdiv(batch, block), interpret=interpret,
           finish=functools.partial(
               finish_permutation, ids_ref, ws_ref, prefix_ref, order_ref, sizes_ref, inverse_ref,
               batch=batch, experts=experts, lanes=lanes, k=k, slots=slots, interpret=interpret))


def permutation(ids: jax.Array, cfg: FrontConfig, *, interpret: bool = False) -> tuple[jax.Array, ...]:
    """The dispatch order of SPEC section 4.1 from given ids, one Pallas kernel (the module
    docstring's three steps; the ids that ``route_collect`` writes).

    Args:
      ids: ``[B, K]`` int32 experts in ``[0, E)``, each row's distinct (routing's output).
      cfg: supplies ``experts`` and ``top_k``.
      interpret: run in Pallas' interpret mode (any machine).

    Returns:
      ``order`` ``[B * K]``, ``group_sizes`` ``[E]`` and ``inverse`` ``[B * K]`` int32, as
      ``reference.routing.permutation``.

    Raises:
      ValueError: ids not ``[B, K]`` int32, an empty batch.
      NotImplementedError: more than ``MAX_PERMUTE_ROWS`` rows or ``MAX_LANES`` experts.
    """
    covers_permutation(ids, cfg)
    batch, k = ids.shape
    lanes = next_power_of_2(cfg.experts)
    block = min(PERMUTE_BLOCK, next_power_of_2(batch))
    kernel = functools.partial(_permute_kernel, batch=batch, experts=cfg.experts, lanes=lanes, k=k,
                               slots=next_power_of_2(k), block=block, interpret=interpret)
    order, sizes, inverse, _, _ = pl.pallas_call(
        kernel,
        out_shape=_permutation_outputs(batch, k, cfg.experts, lanes),
        grid=(pl.cdiv(batch, block),),
        input_output_aliases={1: 3},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="route_permutation",
    )(ids, jnp.zeros(workspace_shape(batch, lanes), jnp.int32))
    return order, sizes, inverse.reshape(-1)
