"""Exact top-k routing as one Pallas kernel (SPEC section 4).

``route(logits, bias, cfg)`` returns, for each row of ``logits`` ``[B, E]`` float32,

    s      = sigmoid(logits)                       float32, 1 / (1 + exp(-x))
    key    = s + bias                              float32
    ids    = the top_k experts by ordered(key)     ties to the lower id, NaN keys lowest
    w      = s[ids], NaN -> 0
    weights = bf16((w * scale) / (tree_sum(w) + 1e-20))   (bf16(w * scale) without renormalize)

exactly as ``reference.route`` (the tree sum pairs slots ``((w0+w1)+(w2+w3))+...``; the division is
correctly rounded).

Schedule. One program per block of ``block_rows`` rows (one row at decode batches, so a B=256 call
spreads over 256 programs on the 132 SMs). A program loads its rows whole, ``E`` experts padded with
masked lanes to ``lanes``, the next power of two (896 -> 1024), and keeps them in registers. Each key
becomes an order-preserving int32: the float bits ``b`` as they are for ``b >= 0``, ``b ^ 0x7FFFFFFF``
for negative floats (the SPEC's uint32 ``ordered`` with its top bit flipped); NaN maps to
``INT32_MIN + 1``, below every number, and the padding lanes to ``INT32_MIN``, below NaN (no float
maps to the ordered values in between, so the order of real keys is untouched). Then ``top_k`` rounds,
unrolled, each one ``argmax`` over the row, which Pallas' Triton lowering reduces as (value, index)
pairs keeping the lower index on equal values: that is rank ``r``'s expert, exactly the SPEC's order
(key descending, id ascending), with no sort, no threshold and no compaction. The chosen lane is set
to ``INT32_MIN`` before the next round; since ``E >= top_k`` real lanes sit above ``INT32_MIN``, every
round picks a new real expert: ``top_k`` distinct ids in ``[0, E)`` for any input, an all-NaN row
included. The weights gather the chosen experts' logits back (``top_k`` loads per row, from L1/L2),
recompute their sigmoids, sum them as the SPEC's pairwise tree over the ``slots`` lanes (``top_k``
padded to a power of two with zeros) and divide.

Backend: Pallas' Triton lowering (``pl.pallas_call`` with ``jax.experimental.pallas.triton``
compiler params; deprecated in jax 0.11 but working). The kernel is a chain of row reductions over a
register-resident row: Triton's ``argmax`` lowering (a (value, index) reduction within threads, warp
shuffles, then shared memory across warps) is exactly the primitive it needs, and masked loads
handle the non-power-of-two expert count. Mosaic GPU (``plgpu.kernel``) has no argmax, sort or
cumsum in 0.11.2: the same selection would be hand-written warp shuffles. On the GPU two operations
use inline PTX: Triton lowers float32 ``/`` to the approximate ``div.full.f32``, so both divisions
(the sigmoid's and the renormalization, which the SPEC asks correctly rounded) use ``div.rn.f32``;
interpret mode uses XLA's division, which is correctly rounded on the CPU. ``exp`` is libdevice's
``__nv_expf`` on the GPU and XLA's on the CPU, where the kernel's sigmoid is bit-equal to the
reference's (XLA expands ``logistic`` to the same ``1 / (1 + exp(-x))``).

Cost per call:
  bytes  = 4 * B * E          logits read (896 experts: 3584 bytes a row)
         + 4 * E              bias, read by every program (from L2 after the first)
         + 4 * B * top_k      the chosen logits read again (from L1/L2)
         + 6 * B * top_k      ids (int32) and weights (bfloat16) written
  FLOPs  = B * E * (sigmoid + add + ~6 integer ops per argmax round * top_k)
so the kernel is latency-bound, not bandwidth-bound: 3.7 KB a row is 0.8 ns of HBM time at 4.65 TB/s,
while the ``top_k`` dependent reductions take microseconds. ``route_bytes`` gives the byte count.

Measured (H200, CUPTI, 2026-12-03, benchmarks/RESULTS.md): 4.48 us at B=1, 4.64 at B=64, 5.82 at
B=256 with the table's schedules; 2.6-3.0x faster than the XLA reference route in the same run, short
of issue #3's targets (3.0 us up to B=64, 5.0 at 256, 4x). The time is the chain of ``top_k``
(value, index) reductions, each one a sequential in-thread combine, warp shuffles and a shared-memory
round across warps. A radix select (the ``top_k``-th key found MSB-first by packed integer counts,
then the chosen lanes compacted by cumsum and masked sums and ranked by a ``[top_k, top_k]``
comparison; commit 99a6d6f, reverted) was measured in the same run and was slower at every batch and
schedule: 4.8-21.9 us, best 4.77 at B=1 with 4 warps, 2-bit digits and an early exit. Packing key
and lane into one int64 (one integer max a round) was 0.5-1 us slower. Triton's own bitonic
``tl.topk`` over the packed keys, outside Pallas (``benchmarks/route_topk_proto.py``, jax-triton),
took 3.6-3.7 us at B <= 64 with 8 warps: faster, still short of 3 us, and GPU-only.
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

MAX_LANES = 4096
"""Widest padded row a program holds in registers (E up to 4096 experts)."""
NAN_KEY = -(2**31) + 1
"""Ordered int32 key of a NaN: below every number (no float maps here)."""
PAD_KEY = -(2**31)
"""Key of a padding lane and of an expert already chosen: below NaN."""


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """Schedule of the routing kernel.

    Attributes:
      block_rows: rows per program, a power of two.
      num_warps: Triton warps per program, a power of two.
    """

    block_rows: int
    num_warps: int

    def __post_init__(self):
        for name in ("block_rows", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
                raise ValueError(f"RouteConfig.{name} must be a power of two >= 1, got {value!r}")


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# Measured on the H200 (benchmarks/bench_route.py --sweep, 2026-12-03): (experts, top_k) -> [(largest
# batch, config)]. One row a program throughout; 4 warps up to B=128 (4.48-4.83 us), 2 at B=256
# (5.82 us against 5.95 with 4).
H200_TABLE: dict[tuple[int, int], list[tuple[int, RouteConfig]]] = {
    (896, 16): [(128, RouteConfig(1, 4)), (256, RouteConfig(1, 2))],
}
TABLES = {"NVIDIA H200": H200_TABLE}


def device_kind() -> str:
    """Kind of the device being compiled for: the abstract mesh's, or the default device's."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.device_kind
    return jax.devices()[0].device_kind


def heuristic_config(batch: int, experts: int, top_k: int) -> RouteConfig:
    """One row per program (decode batches never fill the SMs twice over) and a warp per 256 lanes,
    between 1 and 8 warps."""
    del batch, top_k
    return RouteConfig(1, max(1, min(8, next_power_of_2(experts) // 256)))


def pick_config(batch: int, experts: int, top_k: int) -> RouteConfig:
    """The device's table entry for this shape, else ``heuristic_config``."""
    for limit, config in TABLES.get(device_kind(), {}).get((experts, top_k), []):
        if batch <= limit:
            return config
    return heuristic_config(batch, experts, top_k)


def route_bytes(batch: int, experts: int, top_k: int) -> int:
    """Bytes one call moves (the docstring's count): logits, bias, the chosen logits again, outputs."""
    return 4 * batch * experts + 4 * experts + 4 * batch * top_k + 6 * batch * top_k


def _div(x, y, interpret: bool):
    """Correctly rounded float32 ``x / y`` (Triton's own ``/`` is approximate on the GPU)."""
    if interpret:
        return x / y
    x, y = jnp.broadcast_arrays(x, y)
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


def _tree_sum(w):
    """Pairwise sum over the last axis (a power of two): ``((w0+w1)+(w2+w3))+...``, keeping it as a
    size-1 axis."""
    while w.shape[-1] > 1:
        w = jnp.sum(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), axis=-1)
    return w


def ordered_keys(x, b, lane_ok, interpret: bool):
    """``[rows, lanes]`` float32 logits and ``[lanes]`` bias to order-preserving int32 keys of
    ``sigmoid(x) + b`` (NaN to ``NAN_KEY``; lanes where ``lane_ok`` ``[1, lanes]`` is False, if given,
    to ``PAD_KEY``)."""
    key = _sigmoid(x, interpret) + b[None, :]
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


def routing_weights(chosen, slot, cfg: FrontConfig, interpret: bool):
    """The chosen experts' logits ``[rows, slots]`` float32 (slots past ``cfg.top_k`` ignored) to
    their bfloat16 routing weights (SPEC section 4: NaN sigmoids weigh 0, the tree-sum renormalize)."""
    w = _sigmoid(chosen, interpret)
    w = jnp.where(w != w, jnp.float32(0), w)
    if slot.shape[1] != cfg.top_k:
        w = jnp.where(slot < cfg.top_k, w, jnp.float32(0))
    scaled = w * jnp.float32(cfg.routed_scaling_factor)
    if cfg.renormalize:
        total = _tree_sum(w) + jnp.float32(reference.RENORM_EPSILON)
        scaled = _div(scaled, jnp.broadcast_to(total, scaled.shape), interpret)
    return scaled.astype(jnp.bfloat16)


def _kernel(logits_ref, bias_ref, ids_ref, weights_ref, *, batch, experts, lanes, slots, cfg,
            block_rows, interpret):
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
    ids = select_ranked(ordered, lane, slot, k)
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


def route(
    logits: jax.Array,
    bias: jax.Array,
    cfg: FrontConfig,
    *,
    interpret: bool = False,
    config: RouteConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Exact top-k routing by sigmoid + correction bias (SPEC section 4), one Pallas kernel.

    Args:
      logits: ``[B, E]`` float32 router logits, ``B >= 1``.
      bias: ``[E]`` float32 correction bias.
      cfg: supplies ``experts``, ``top_k``, ``routed_scaling_factor`` and ``renormalize``.
      interpret: run in Pallas' interpret mode (any machine).
      config: the schedule; None picks the device's table entry or the heuristic.

    Returns:
      ``ids`` ``[B, K]`` int32 (rank 0 the largest key, ties to the lower id, NaN keys lowest; always
      ``K`` distinct ids in ``[0, E)``) and ``weights`` ``[B, K]`` bfloat16, as ``reference.route``.

    Raises:
      ValueError: wrong shapes or dtypes, an empty batch.
      NotImplementedError: more than 4096 experts (use ``backend='xla'``).

    Example::

      ids, weights = route(logits, params.bias, cfg)
    """
    _check(logits, bias, cfg)
    batch, experts = logits.shape
    config = config or pick_config(batch, experts, cfg.top_k)
    if not isinstance(config, RouteConfig):
        raise ValueError(f"config must be a RouteConfig or None, got {type(config).__name__}")
    block_rows = min(config.block_rows, next_power_of_2(batch))
    kernel = functools.partial(
        _kernel,
        batch=batch,
        experts=experts,
        lanes=next_power_of_2(experts),
        slots=next_power_of_2(cfg.top_k),
        cfg=cfg,
        block_rows=block_rows,
        interpret=interpret,
    )
    ids, weights = pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.int32),
            jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.bfloat16),
        ],
        grid=(pl.cdiv(batch, block_rows),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="route",
    )(logits, bias)
    return ids, weights
