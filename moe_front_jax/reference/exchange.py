"""Tensor parallelism's collectives in plain ``lax``: the exchange of the ranks' shards and the
reduction of the shared expert's partial sums (run inside ``jax.shard_map`` over the ranks' axis).

``exchange`` carries every rank's logits and latent shard to every rank in ONE all-gather of mailbox
rows; ``gather_shards`` gathers them for a local publish into a mailbox (SPEC section 7's ``"gather"``
transport); ``reduce_shared`` sums the shared expert's float32 partials, then rounds once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def exchange(
    logits: jax.Array, latent_shard: jax.Array, axis_name: str
) -> tuple[jax.Array, jax.Array]:
    """Every rank's logits and latent shard, to every rank, in ONE all-gather over ``axis_name``.

    Each rank packs its row as a mailbox row would (SPEC section 7): ``[latent shard as bf16 | logits
    as float32 words, two 16-bit columns each]``, ``[B, shard + 2 valid]`` uint16, so the exchange is a
    single collective of ``B * (L + 2E) * 2 / tp`` bytes per rank, bit-exact (NaN payloads, -0.0).

    Args:
      logits: ``[B, valid]`` float32, this rank's experts ``[r*valid, (r+1)*valid)``.
      latent_shard: ``[B, shard]`` bfloat16, this rank's latent columns ``[r*shard, (r+1)*shard)``.
      axis_name: the ``shard_map`` axis of the ``tp`` ranks.

    Returns:
      ``logits`` ``[B, tp*valid]`` float32 and ``latent`` ``[B, tp*shard]`` bfloat16, every rank's
      shard in rank order, identical (invariant) on every rank.
    """
    rows, valid = logits.shape
    shard = latent_shard.shape[1]
    words = lax.bitcast_convert_type(logits, jnp.uint16).reshape(rows, 2 * valid)
    halves = lax.bitcast_convert_type(latent_shard, jnp.uint16)
    mailbox_row = jnp.concatenate([halves, words], axis=1)
    # A leading axis of 1 gathered tiled, rather than a new axis: the gathered [tp, B, W] then keeps
    # the batch dimension in place under meshes whose other axes carry explicit shardings.
    gathered = lax.all_gather(mailbox_row[None], axis_name, axis=0, tiled=True, to="invarying")
    tp = gathered.shape[0]
    latent = lax.bitcast_convert_type(gathered[:, :, :shard], jnp.bfloat16)
    words = gathered[:, :, shard:].reshape(tp, rows, valid, 2)
    logits = lax.bitcast_convert_type(words, jnp.float32)
    return (
        logits.transpose(1, 0, 2).reshape(rows, tp * valid),
        latent.transpose(1, 0, 2).reshape(rows, tp * shard),
    )


def reduce_shared(partial: jax.Array, axis_name: str, shared_reduce: str) -> jax.Array:
    """Sum the ranks' float32 shared-expert partial sums ``[B, H]``, then round once to bfloat16.

    The partial sums travel in float32 (twice the bytes of bfloat16) so that the result is the
    unsharded shared expert up to float32 summation order: bfloat16 partials would add one rounding
    per rank, and a collective that sums in bfloat16 another per step, an error growing with tp.

    Returns:
      ``"psum"``: ``[B, H]`` bfloat16 on every rank; ``"psum_scatter"``: ``[B, H/tp]`` bfloat16, rank
      ``r`` holding hidden columns ``[r*H/tp, (r+1)*H/tp)``.
    """
    if shared_reduce == "psum":
        total = lax.psum(partial, axis_name)
    else:
        total = lax.psum_scatter(partial, axis_name, scatter_dimension=1, tiled=True)
    return total.astype(jnp.bfloat16)


def gather_shards(logits: jax.Array, latent_shard: jax.Array, axis_name: str) -> tuple[jax.Array, ...]:
    """Every rank's ``logits`` ``[B, E/tp]`` and ``latent_shard`` ``[B, L/tp]`` over ``axis_name``.

    Returns ``(logits_0, ..., logits_{tp-1}, latent_0, ..., latent_{tp-1})``, rank order.
    """
    every_logits = lax.all_gather(logits, axis_name)
    every_latent = lax.all_gather(latent_shard, axis_name)
    tp = every_logits.shape[0]
    return (*(every_logits[rank] for rank in range(tp)), *(every_latent[rank] for rank in range(tp)))
