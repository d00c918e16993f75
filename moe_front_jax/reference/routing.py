"""Routing (SPEC section 4): exact top-k of sigmoid(logits) + bias, ties to the lower id, NaN lowest,
within the best expert groups where the config has groups (4.2), or of the logits with softmax weights
(4.3); the renormalized bfloat16 weights, and (``permute``) the dispatch order of SPEC section 4.1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from moe_front_jax.config import FrontConfig


RENORM_EPSILON = 1e-20
"""Added to the weight sum before the division, so an all-zero selection gives zero weights."""


def ordered_key(value: jax.Array) -> jax.Array:
    """Monotone uint32 image of float32 ``value``; NaN maps to 0, below every number.

    ``~bits`` where the sign bit is set, else ``bits | 0x80000000`` (SPEC section 4 step 2). Note that
    ``-0.0`` orders just below ``+0.0``.
    """
    bits = lax.bitcast_convert_type(value.astype(jnp.float32), jnp.uint32)
    negative = (bits & jnp.uint32(0x80000000)) != 0
    key = jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))
    return jnp.where(jnp.isnan(value), jnp.uint32(0), key)


def top_k_of_keys(keys: jax.Array, k: int) -> jax.Array:
    """Positions ``[..., k]`` int32 of the ``k`` largest uint32 ``keys`` along the last axis, largest
    first, ties to the lower position."""
    # top_k breaks ties by the lower index; int32 (ordered ^ sign bit) keeps the order of uint32.
    signed = lax.bitcast_convert_type(keys ^ jnp.uint32(0x80000000), jnp.int32)
    return lax.top_k(signed, k)[1].astype(jnp.int32)


def group_scores(keys: jax.Array, cfg: FrontConfig) -> jax.Array:
    """Each group's score ``[B, G]`` float32 from the selection keys ``[B, E]`` (SPEC section 4.2):
    the float32 sum of the group's two largest keys in the order of ``ordered_key``."""
    grouped = keys.reshape(keys.shape[0], cfg.groups, cfg.experts_per_group)
    best = jnp.take_along_axis(grouped, top_k_of_keys(ordered_key(grouped), 2), axis=-1)
    return best[..., 0] + best[..., 1]


def kept_groups(keys: jax.Array, cfg: FrontConfig) -> jax.Array:
    """The ``topk_groups`` best groups ``[B, topk_groups]`` int32 in increasing id (SPEC section
    4.2): the largest ``group_scores``, ties to the lower group id, NaN lowest."""
    return jnp.sort(top_k_of_keys(ordered_key(group_scores(keys, cfg)), cfg.topk_groups), axis=-1)


def select(keys: jax.Array, cfg: FrontConfig) -> jax.Array:
    """The chosen experts ``[B, K]`` int32 from the float32 selection keys ``[B, E]``: the top-k by
    ``ordered_key``, ties to the lower id; with groups, among the kept groups' experts only."""
    ordered = ordered_key(keys)
    if cfg.topk_groups == cfg.groups:  # every group kept: the plain top-k
        return top_k_of_keys(ordered, cfg.top_k)
    n = cfg.experts_per_group
    kept = kept_groups(keys, cfg)
    # The kept groups' experts in increasing id, so a tie still goes to the lower expert id.
    candidates = (kept[..., None] * n + jnp.arange(n, dtype=jnp.int32)).reshape(keys.shape[0], -1)
    position = top_k_of_keys(jnp.take_along_axis(ordered, candidates, axis=-1), cfg.top_k)
    return jnp.take_along_axis(candidates, position, axis=-1)


def softmax_scores(logits: jax.Array) -> jax.Array:
    """Each row's softmax ``[B, E]`` float32 (SPEC section 4.3): NaN logits taken as -inf,
    ``exp(l - max)`` over the tree sum of the row, a correctly rounded division; NaN where the
    largest logit is infinite."""
    finite = jnp.where(jnp.isnan(logits), -jnp.inf, logits.astype(jnp.float32))
    e = jnp.exp(finite - jnp.max(finite, axis=-1, keepdims=True))
    total = lax.optimization_barrier(jnp.broadcast_to(tree_sum(e)[..., None], e.shape))
    return e / total


def tree_sum(values: jax.Array) -> jax.Array:
    """Pairwise tree sum over the last axis, as a butterfly over lanes ``0..K-1`` adds.

    ``((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7))...`` in float32; a K that is not a power of two is padded
    with zeros up to the next one (the idle lanes of the butterfly).
    """
    k = values.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    if width != k:
        pad = [(0, 0)] * (values.ndim - 1) + [(0, width - k)]
        values = jnp.pad(values, pad)
    while values.shape[-1] > 1:
        values = values[..., 0::2] + values[..., 1::2]
    return values[..., 0]


def routing_weights(chosen_scores: jax.Array, cfg: FrontConfig) -> jax.Array:
    """bfloat16 weights from the chosen experts' unbiased scores ``[B, K]`` (sigmoids, or softmax
    probabilities; SPEC section 4 step 4).

    NaN scores weigh 0 and stay out of the sum; with ``renormalize`` each weight is
    ``bf16((w * scale) / (tree_sum(w) + 1e-20))`` in float32, else ``bf16(w * scale)``.
    """
    w = jnp.where(jnp.isnan(chosen_scores), jnp.float32(0), chosen_scores.astype(jnp.float32))
    scaled = w * jnp.float32(cfg.routed_scaling_factor)
    if cfg.renormalize:
        total = tree_sum(w)[..., None] + jnp.float32(RENORM_EPSILON)
        # XLA's simplifier turns a division by a broadcast into a multiplication by its reciprocal,
        # which rounds differently from the correctly rounded division the SPEC asks for; the
        # barrier keeps the full-shape denominator opaque to that rewrite.
        denominator = lax.optimization_barrier(jnp.broadcast_to(total, scaled.shape))
        scaled = scaled / denominator
    return scaled.astype(jnp.bfloat16)


def permutation(ids: jax.Array, cfg: FrontConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The dispatch order of SPEC section 4.1 from ``ids`` ``[B, K]`` int32 in ``[0, E)``.

    A stable sort by expert of the flat slots ``s = token * K + rank`` (``ids.ravel()``): the slots
    of expert 0 first, each expert's in increasing token order.

    Returns:
      ``order`` ``[B * K]`` int32 (``ids.ravel()[order]`` non-decreasing, slots increasing within
      an expert), ``group_sizes`` ``[E]`` int32 (the histogram of ``ids``, summing to ``B * K``) and
      ``inverse`` ``[B * K]`` int32, the position of each slot in ``order`` (``order[inverse] ==
      arange``).
    """
    flat = ids.reshape(-1).astype(jnp.int32)
    slots = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((cfg.experts,), jnp.int32).at[flat].add(1)
    inverse = jnp.zeros((slots,), jnp.int32).at[order].set(jnp.arange(slots, dtype=jnp.int32))
    return order, group_sizes, inverse


def route(
    logits: jax.Array, bias: jax.Array, cfg: FrontConfig, *, permute: bool = False
) -> tuple[jax.Array, ...]:
    """Exact top-k routing (SPEC section 4): sigmoid + correction bias, within the kept groups
    (4.2), or softmax (4.3), as ``cfg.scoring`` and ``cfg.groups`` say.

    Args:
      logits: ``[B, E]`` float32 router logits (all experts, every rank's shard).
      bias: ``[E]`` float32 ``e_score_correction_bias`` (zeros without one; softmax never reads it).
      cfg: supplies the routing fields (``top_k``, groups, ``scoring``, scale, ``renormalize``).
      permute: also return the dispatch order (``permutation``; static).

    Returns:
      ``ids`` ``[B, K]`` int32, rank 0 the largest key, ties to the lower expert id, NaN keys lowest;
      ``weights`` ``[B, K]`` bfloat16 from the unbiased scores; with ``permute``, then
      ``permutation(ids, cfg)``'s ``order``, ``group_sizes`` and ``inverse``.
    """
    logits = logits.astype(jnp.float32)
    if cfg.scoring == "softmax":
        ids = select(logits, cfg)
        scores = softmax_scores(logits)
    else:
        scores = jax.nn.sigmoid(logits)
        ids = select(scores + bias.astype(jnp.float32), cfg)
    weights = routing_weights(jnp.take_along_axis(scores, ids, axis=-1), cfg)
    if permute:
        return (ids, weights, *permutation(ids, cfg))
    return ids, weights
