"""The routing reference (SPEC section 4) against the numpy oracle and hand-derived values."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference
import oracle

K3 = mf.KIMI_K3
CONFIGS = {
    "k3": K3,
    "e256_top8": mf.FrontConfig(hidden=256, experts=256, top_k=8, latent=128, shared=0),
    "e384_top8": mf.FrontConfig(hidden=256, experts=384, top_k=8, latent=128, shared=0),
}


@functools.partial(jax.jit, static_argnums=2)
def jit_route(logits, bias, cfg):
    return mf.route(logits, bias, cfg, backend="xla")


def run(logits, bias, cfg=K3):
    ids, weights = jit_route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    return np.asarray(ids), np.asarray(weights)


def assert_matches_oracle(logits, bias, cfg=K3):
    ids, weights = run(logits, bias, cfg)
    want_ids, want_weights = oracle.route(
        logits, bias, cfg.top_k, cfg.routed_scaling_factor, cfg.renormalize
    )
    np.testing.assert_array_equal(ids, want_ids)
    assert oracle.bf16_ulp_distance(weights, want_weights).max() <= 1
    return ids, weights


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("batch", [1, 3, 37, 255])
def test_random_rows(name, batch):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(batch + cfg.experts)
    logits = rng.normal(0, 2, (batch, cfg.experts)).astype(np.float32)
    bias = rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32)
    ids, weights = assert_matches_oracle(logits, bias, cfg)
    oracle.assert_valid_ids(ids, cfg.experts)
    sums = weights.astype(np.float32).sum(-1)
    np.testing.assert_allclose(sums, 1.0, atol=cfg.top_k * 2.0**-8)


def test_ordered_key_hand_values():
    values = np.array([np.nan, -np.inf, -1.0, -0.0, 0.0, 1e-45, 1.0, np.inf], np.float32)
    keys = np.asarray(reference.ordered_key(jnp.asarray(values)))
    want = [0, 0x007FFFFF, 0x407FFFFF, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xBF800000, 0xFF800000]
    np.testing.assert_array_equal(keys, np.array(want, np.uint32))


def test_bit_equal_keys_tie_to_lower_id():
    logits = np.full((2, K3.experts), 0.3, np.float32)
    logits[1, ::7] = 0.9  # 128 bit-equal winners: the lowest 16 ids among them
    ids, weights = assert_matches_oracle(logits, np.zeros(K3.experts))
    np.testing.assert_array_equal(ids[0], np.arange(16))
    np.testing.assert_array_equal(ids[1], np.arange(16) * 7)
    np.testing.assert_array_equal(weights.astype(np.float32), np.full((2, 16), 1 / 16, np.float32))


def test_all_equal_row_and_zero_signs():
    logits = np.zeros((1, K3.experts), np.float32)
    logits[0, 1::2] = -0.0  # sigmoid(-0.0) == sigmoid(+0.0): every key is bit-equal
    ids, weights = assert_matches_oracle(logits, np.zeros(K3.experts))
    np.testing.assert_array_equal(ids[0], np.arange(16))
    np.testing.assert_array_equal(weights.astype(np.float32)[0], np.full(16, 1 / 16, np.float32))


def test_nan_logits_rank_lowest():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (2, K3.experts)).astype(np.float32)
    logits[0, :100] = np.nan  # enough numbers left: no NaN expert is chosen
    logits[1, :] = np.nan
    logits[1, [500, 40, 890, 7, 300]] = [3.0, 2.0, 1.0, 0.0, -1.0]
    ids, weights = assert_matches_oracle(logits, np.zeros(K3.experts))
    assert (ids[0] >= 100).all()
    np.testing.assert_array_equal(ids[1, :5], [500, 40, 890, 7, 300])
    # The rest are NaN keys (ordered 0): the lowest free ids, weighing 0.
    np.testing.assert_array_equal(ids[1, 5:], [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11])
    assert (weights[1, 5:].astype(np.float32) == 0).all()
    assert not np.isnan(weights.astype(np.float32)).any()


def test_all_nan_row():
    logits = np.full((3, K3.experts), np.nan, np.float32)
    ids, weights = assert_matches_oracle(logits, np.zeros(K3.experts))
    np.testing.assert_array_equal(ids, np.tile(np.arange(16), (3, 1)))
    np.testing.assert_array_equal(weights.astype(np.float32), np.zeros((3, 16), np.float32))


def test_nan_bias_ranks_lowest_but_weighs_its_sigmoid():
    logits = np.zeros((1, K3.experts), np.float32)
    logits[0, 3] = 10.0
    bias = np.zeros(K3.experts, np.float32)
    bias[3] = np.nan
    ids, _ = assert_matches_oracle(logits, bias)
    assert 3 not in ids[0]
    # With every key NaN but two, the NaN-keyed experts fill the lowest ranks in id order, and
    # expert 3 weighs its own sigmoid: sigmoid(10) against fifteen sigmoid(0) = 0.5.
    bias[:] = np.nan
    bias[[9, 2]] = 0.0
    ids, weights = assert_matches_oracle(logits, bias)
    np.testing.assert_array_equal(ids[0], [2, 9, 0, 1, *range(3, 9), *range(10, 16)])
    s3 = 1.0 / (1.0 + np.exp(-10.0))
    total = s3 + 15 * 0.5
    assert weights[0, 4] == np.float32(s3 / total).astype(weights.dtype)
    assert weights[0, 0] == np.float32(0.5 / total).astype(weights.dtype)


def test_infinities():
    logits = np.zeros((1, K3.experts), np.float32)
    logits[0, [300, 7]] = np.inf  # sigmoid 1.0 exactly: bit-equal keys, 7 first
    logits[0, 1:3] = -np.inf  # sigmoid 0.0: below every finite logit here
    ids, _ = assert_matches_oracle(logits, np.zeros(K3.experts))
    np.testing.assert_array_equal(ids[0, :3], [7, 300, 0])
    assert 1 not in ids[0] and 2 not in ids[0]


@pytest.mark.parametrize("direction", [1, -1])
def test_bias_makes_every_key_negative(direction):
    logits = np.zeros((1, K3.experts), np.float32)
    bias = (-3.0 + direction * 0.001 * np.arange(K3.experts)).astype(np.float32)
    ids, _ = assert_matches_oracle(logits, bias)
    want = np.arange(16) if direction < 0 else K3.experts - 1 - np.arange(16)
    np.testing.assert_array_equal(ids[0], want)


def test_tree_sum_order():
    # Sequentially, each 2**-24 rounds away against 1.0; pairwise they add up first.
    values = np.array([1.0] + [2.0**-24] * 15, np.float32)
    total = np.asarray(reference.tree_sum(jnp.asarray(values)))
    assert total == np.float32(1 + 7 * 2.0**-23)
    assert np.float32(sum(values.tolist()[1:], np.float32(1.0))) == np.float32(1.0)
    odd = np.array([1.0, 2.0, 3.0], np.float32)  # padded with a zero lane: (1+2)+(3+0)
    assert np.asarray(reference.tree_sum(jnp.asarray(odd))) == np.float32(6.0)


def test_multiply_then_divide_order():
    """bf16((w * scale) / (total + 1e-20)): find rows where other orders round differently."""
    cfg = mf.FrontConfig(hidden=64, experts=64, top_k=16, latent=32, shared=0,
                         routed_scaling_factor=2.5)
    rng = np.random.default_rng(7)
    w = rng.uniform(0.05, 1.0, (65536, 16)).astype(np.float32)
    total = oracle.tree_sum32(w)[:, None] + np.float32(1e-20)
    want = ((w * np.float32(2.5)) / total).astype(oracle.BF16)
    other = (w * (np.float32(2.5) / total)).astype(oracle.BF16)
    differs = (want.view(np.uint16) != other.view(np.uint16)).any(-1)
    assert differs.sum() >= 5  # the inputs discriminate between the two orders
    got = np.asarray(jax.jit(reference.routing_weights, static_argnums=1)(jnp.asarray(w), cfg))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_without_renormalize():
    cfg = mf.FrontConfig(hidden=64, experts=128, top_k=8, latent=32, shared=0,
                         routed_scaling_factor=2.5, renormalize=False)
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (5, 128)).astype(np.float32)
    ids, weights = assert_matches_oracle(logits, np.zeros(128, np.float32), cfg)
    s = oracle.sigmoid32(np.take_along_axis(logits, ids, -1))
    assert oracle.bf16_ulp_distance(weights, (s * np.float32(2.5)).astype(oracle.BF16)).max() <= 1
