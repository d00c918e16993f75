"""The mailbox's test cases, shared by its tests, the peer stores' and ``route_collect``'s: small
configs whose rows end in padding, the armed state from the SPEC, -0 canonicalized in numpy (the
expected values, never the mailbox code's), rows, weights and shards made by numpy, and the check of
an output through a mailbox against the direct path's."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.pallas.front_gemm import ticket_count
from bitwise import assert_bits_equal

# Small configs: E and L/2 are not multiples of 4 words, so rows end in padding and chunks straddle
# the latent/logits boundary. TP8 shards 8 ranks of 4 experts and 8 latent columns each.
SMALL = mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=34, shared=0, plan_block=2)
TP2 = mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=36, shared=0, tp=2, plan_block=2)
TP8 = mf.FrontConfig(hidden=64, experts=32, top_k=4, latent=64, shared=0, tp=8)
SENTINEL = 0x80000000


def canonical_logits(logits):
    bits = np.asarray(logits, np.float32).view(np.uint32)
    return np.where(bits == SENTINEL, np.uint32(0), bits).view(np.float32)


def canonical_latent(latent):
    bits = np.asarray(latent).view(np.uint16)
    return np.where(bits == 0x8000, np.uint16(0), bits).view(ml_dtypes.bfloat16)


def expected_armed(cfg, generations, capacity):
    """Armed words from the SPEC: (L + 2E) / 2 data words of 0x80000000, zeros to a multiple of 4."""
    data = (cfg.latent + 2 * cfg.experts) // 2
    words = -(-data // 4) * 4
    rows = np.zeros((generations, capacity, words), np.uint32)
    rows[..., :data] = SENTINEL
    return rows


def tickets_of(cfg):
    """Tile counters of a mailbox for ``cfg``: the front GEMM publish's, over one rank's rows."""
    return ticket_count(cfg.experts_per_rank, cfg.latent_per_rank)


def assert_armed(box, steps):
    """Armed, after ``steps`` publishes: step t used generation t mod G, so both control words hold
    the last step's generation, ``G - 1`` for a new mailbox; every tile counter is zero."""
    assert_bits_equal(box.buffer, expected_armed(box.cfg, box.generations, box.capacity))
    last = (steps - 1) % box.generations
    np.testing.assert_array_equal(np.asarray(box.control), [last, last])
    np.testing.assert_array_equal(np.asarray(box.tickets), np.zeros(tickets_of(box.cfg)))


def rows_of(cfg, batch, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.normal(size=(batch, cfg.hidden)) * 2).astype(ml_dtypes.bfloat16))


def weights_of(cfg, seed):
    """Weights under the SPEC's keys (no shared expert), made by numpy: no JAX op to compile."""
    rng = np.random.default_rng(seed)

    def normal(rows, cols):
        return jnp.asarray((rng.normal(size=(rows, cols)) / np.sqrt(cols)).astype(ml_dtypes.bfloat16))

    bias = rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32)
    return {
        "gate.weight": normal(cfg.experts, cfg.hidden),
        "gate.e_score_correction_bias": jnp.asarray(bias),
        "routed_down_weight": normal(cfg.latent, cfg.hidden),
    }


def shards_with_negative_zeros(cfg, batch, seed):
    """Logits and latent shards whose rows are all -0, mixed -0 and tiny negatives, or random."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(batch, cfg.experts_per_rank)).astype(np.float32)
    latent = rng.normal(size=(batch, cfg.latent_per_rank)).astype(ml_dtypes.bfloat16)
    logits[0], latent[0] = -0.0, -0.0
    if batch > 1:
        # -0 beside the smallest negative subnormals, which share the sign bit but are not -0.
        logits[1, 0::2] = -0.0
        logits[1, 1::2] = np.array([0x80000001], np.uint32).view(np.float32)[0]
        latent[1, 0::2] = -0.0
        latent[1, 1::2] = np.array([0x8001], np.uint16).view(ml_dtypes.bfloat16)[0]
    return jnp.asarray(logits), jnp.asarray(latent)


plan_of = jax.jit(reference.mxfp8_plan, static_argnums=1)


def assert_equals_direct(got, want, plan_block=None):
    """``moe_front``'s output ``got`` through a mailbox against the direct path's ``want``: status
    0, ids and weights bit-equal, logits and latent bit-equal to ``want``'s with -0 canonicalized;
    with ``plan_block`` the plan bit-equal to the reference's of that canonical latent."""
    assert int(got.status) == 0
    assert_bits_equal(got.ids, want.ids)
    assert_bits_equal(got.weights, want.weights)
    assert_bits_equal(got.logits, canonical_logits(want.logits))
    assert_bits_equal(got.latent, canonical_latent(want.latent))
    if plan_block is not None:
        plan = plan_of(jnp.asarray(canonical_latent(want.latent)), plan_block)
        assert_bits_equal(got.plan[0], plan[0])
        assert_bits_equal(got.plan[1], plan[1])
