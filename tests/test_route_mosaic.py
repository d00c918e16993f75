"""The Mosaic GPU routing kernels (``pallas/route/mosaic.py``): interpret mode bit-equal to the reference
on SPEC section 4's edge cases, on random and adversarial rows at B = 1, 3, 37, 64, 255 and on other
shapes, weights correctly rounded on a row at a bf16 midpoint, the dispatch order of SPEC 4.1 (after
routing and from given ids, below, at and past 64 slots); every routing family the kernel covers
(groups of 4.2, softmax of 4.3) on random rows and the edge cases of both levels, each schedule of
``MosaicRouteConfig``, and the property that grouped routing stays within the kept groups; what it
does not cover; lowering for an H200 from the CPU host, for every family and schedule; on a GPU
against the XLA reference on the same device, for every family and schedule"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.reference import routing as reference_routing
from moe_front_jax.pallas.route import kernel as rk
from moe_front_jax.pallas.route import mosaic as mr
from bitwise import assert_each_bits_equal
from h200 import lower_for_h200
from route_cases import (
    CLEAR_ULPS, ROUNDING_ROW, adversarial_ids, adversarial_rows, assert_argument_errors,
    assert_dispatch, assert_edge_ids, assert_valid, compare_with_xla_on_gpu, edge_rows,
    oracle_clear_rows, rows_of_kind)
import oracle

K3 = mf.KIMI_K3
CONFIGS = {
    "e256_top8": mf.FrontConfig(hidden=256, experts=256, top_k=8, latent=128, shared=0),
    "e384_top8_scaled": mf.FrontConfig(
        hidden=256, experts=384, top_k=8, latent=128, shared=0, routed_scaling_factor=2.5),
    "e1024_top32": mf.FrontConfig(hidden=256, experts=1024, top_k=32, latent=128, shared=0),
    "e64_top6_plain": mf.FrontConfig(hidden=256, experts=64, top_k=6, latent=128, shared=0,
                                     routed_scaling_factor=2.5, renormalize=False),
}


def _covered(cfg) -> bool:
    """Whether ``mr.covers`` takes a row of ``cfg``."""
    try:
        mr.covers(jnp.zeros((1, cfg.experts), jnp.float32), jnp.zeros((cfg.experts,), jnp.float32),
                  cfg)
    except NotImplementedError:
        return False
    return True


FAMILIES = {name: cfg for name, cfg in mf.configs.PRESETS.items() if _covered(cfg)}
"""The presets the kernel covers: every one but Mixtral-8x7B (8 experts)."""
GROUPED_SHAPES = {
    "g8_of_8_k4": mf.FrontConfig(hidden=64, experts=64, top_k=8, latent=0, shared=0, groups=8,
                                 topk_groups=4, routed_scaling_factor=2.5),
    "g8_of_8_k1": mf.FrontConfig(hidden=64, experts=64, top_k=6, latent=0, shared=0, groups=8,
                                 topk_groups=1),
    "g8_of_64_k3": mf.FrontConfig(hidden=64, experts=512, top_k=8, latent=0, shared=0, groups=8,
                                  topk_groups=3, renormalize=False),
    "g32_of_2_k8": mf.FrontConfig(hidden=64, experts=64, top_k=12, latent=0, shared=0, groups=32,
                                  topk_groups=8),
    "g8_of_32_k1": mf.FrontConfig(hidden=64, experts=256, top_k=8, latent=0, shared=0, groups=8,
                                  topk_groups=1),
}
"""Grouped shapes beside DeepSeek-V3's: groups of 8 lanes, of 2, of 2 registers; one group kept."""
SOFTMAX_SHAPES = {
    "e64_top6_plain": mf.FrontConfig(hidden=64, experts=64, top_k=6, latent=0, shared=0,
                                     scoring="softmax", bias=False, renormalize=False,
                                     routed_scaling_factor=2.0),
    "e896_top16": dataclasses.replace(K3, scoring="softmax", bias=False),
    "e64_top32": mf.FrontConfig(hidden=64, experts=64, top_k=32, latent=0, shared=0,
                                scoring="softmax", bias=False),
}
"""Softmax shapes beside Qwen3's: no renormalize, K3's 896 (28 lane sums), half the experts chosen.
"""
VARIANTS = [
    mr.MosaicRouteConfig(cached=1), mr.MosaicRouteConfig(cached=8, unroll=3),
    mr.MosaicRouteConfig(unroll=8), mr.MosaicRouteConfig(split=True),
    mr.MosaicRouteConfig(split=True, cached=2, unroll=2),
    mr.MosaicRouteConfig(warpgroups=2, split=True), mr.MosaicRouteConfig(warpgroups=4, cached=4),
    mr.MosaicRouteConfig(steps=3, split=True), mr.MosaicRouteConfig(warpgroups=2, steps=2),
    mr.MosaicRouteConfig(lane_weights=True),
    mr.MosaicRouteConfig(warpgroups=2, steps=2, split=True, lane_weights=True),
]
"""Schedules beside the default: a refill every round, deep caches, 8 rounds a step of the loop (a
top 8's rounds all unrolled, no loop; Kimi-K3's 16 in two steps: ``unroll`` beyond ``top_k`` lowers
to the same kernel, and K3's 16 unrolled made the GPU test too slow to finish), the keys split over
the warps, several rows a CTA side by side and in turn (partial CTAs at odd B), the weights one a
lane."""


@functools.partial(jax.jit, static_argnames=("cfg", "permute", "config"))
def interpret(logits, bias, *, cfg, permute=False, config=None):
    return mr.route(logits, bias, cfg, interpret=True, permute=permute, config=config)


@functools.partial(jax.jit, static_argnames="cfg")
def interpret_permutation(ids, *, cfg):
    return mr.permutation(ids, cfg, interpret=True)


reference_route = jax.jit(reference.route, static_argnums=2, static_argnames="permute")


def check(logits, bias, cfg=K3, permute=False, config=None):
    """Interpret mode against the reference, bit for bit (on the CPU the kernel's sigmoid, exp, tree
    sums and division are the reference's); with plain sigmoid routing also against the float64
    oracle's ids on rows without a near tie (weights within a bf16 ulp where the ids agree); with
    groups, every id within the oracle's kept groups. Returns ``(ids, weights)`` as numpy."""
    logits = jnp.asarray(logits, jnp.float32)
    bias = jnp.asarray(bias, jnp.float32)
    got = interpret(logits, bias, cfg=cfg, permute=permute, config=config)
    want = reference_route(logits, bias, cfg, permute=permute)
    assert_each_bits_equal(got, want)
    ids, weights = np.asarray(got[0]), np.asarray(got[1])
    assert_valid(ids, weights, cfg.experts)
    if permute:
        assert_dispatch(ids, *got[2:], cfg.experts)
    if cfg.topk_groups < cfg.groups:
        assert_within_kept_groups(ids, logits, bias, cfg)
    if cfg.scoring == "softmax" or cfg.topk_groups < cfg.groups:
        return ids, weights
    want_ids, want_weights = oracle.route(np.asarray(logits), np.asarray(bias), cfg.top_k,
                                          cfg.routed_scaling_factor, cfg.renormalize)
    clear = oracle_clear_rows(logits, bias, cfg.top_k)
    np.testing.assert_array_equal(ids[clear], want_ids[clear])
    same = (ids == want_ids).all(axis=1)
    assert oracle.bf16_ulp_distance(weights[same], want_weights[same]).max(initial=0) <= 1
    return ids, weights


def assert_within_kept_groups(ids, logits, bias, cfg):
    """Every id lies in one of the oracle's kept groups of its row, from the keys of XLA's sigmoid
    (the reference's: an oracle sigmoid an ulp away could move a near tie between groups)."""
    keys = np.asarray(jax.nn.sigmoid(jnp.asarray(logits)) + jnp.asarray(bias), np.float32)
    for row, kept in zip(np.asarray(ids), oracle.kept_groups(keys, cfg.groups, cfg.topk_groups)):
        assert set(row // cfg.experts_per_group) <= set(kept), (row, kept)


# --- SPEC section 4's edge cases ---------------------------------------------------------------------


def test_edge_rows():
    """Bit-equal keys (the lowest ids win), all-equal rows of +0.0 and -0.0, all-NaN rows, NaN
    sprinkled, +-inf logits, the 16 winners at the top ids: ``test_route_kernel.edge_rows``."""
    ids, weights = check(edge_rows(K3.experts), np.zeros(K3.experts))
    np.testing.assert_array_equal(ids[0], np.arange(16) * 7)
    np.testing.assert_array_equal(ids[1], np.arange(16))
    np.testing.assert_array_equal(ids[2], np.arange(16))
    np.testing.assert_array_equal(ids[4, :3], [7, 300, 0])
    assert 1 not in ids[4] and 2 not in ids[4]
    np.testing.assert_array_equal(ids[5], np.arange(16))
    np.testing.assert_array_equal(ids[6], np.arange(880, 896))
    np.testing.assert_array_equal(ids[7], [500, 40, 890, 7, 300, 0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11])
    assert (ids[3] >= 100).all()
    np.testing.assert_array_equal(weights[[2, 5]].astype(np.float32), np.zeros((2, 16)))
    np.testing.assert_array_equal(weights[1].astype(np.float32), np.full(16, 1 / 16, np.float32))


def test_ties_straddling_the_cut():
    logits = np.zeros((1, K3.experts), np.float32)
    logits[0, 100:113] = np.linspace(3.0, 2.0, 13)
    logits[0, [800, 40, 600, 41, 5]] = 1.0
    ids, _ = check(logits, np.zeros(K3.experts))
    np.testing.assert_array_equal(ids[0], list(range(100, 113)) + [5, 40, 41])


def test_zero_signs_and_nan_and_infinite_biases():
    """A -0.0 bias on a zero score ties with +0.0; NaN biases rank lowest but weigh their
    sigmoid; infinite biases rank first and last (above NaN)."""
    logits = np.full((3, K3.experts), -np.inf, np.float32)
    bias = np.full(K3.experts, -1.0, np.float32)
    bias[3] = -0.0
    bias[500:520] = 0.0
    logits[1] = 0.0
    logits[1, 3] = 10.0
    logits[2, 5:] = np.nan
    logits[2, 50] = np.inf
    bias[[600, 4]] = np.inf
    bias[9] = np.nan
    ids, weights = check(logits, bias)
    np.testing.assert_array_equal(ids[0], [4, 600, 3] + list(range(500, 513)))
    np.testing.assert_array_equal(ids[1], [4, 600, 3] + list(range(500, 513)))
    np.testing.assert_array_equal(ids[2, :5], [4, 3, 50, 0, 1])  # 3 (+0.0 key) ties with 50
    assert 9 not in ids[0] and 9 not in ids[1]
    bias[:] = np.nan
    bias[[9, 2]] = 0.0
    ids, weights = check(np.zeros((1, K3.experts), np.float32), bias)
    np.testing.assert_array_equal(ids[0, :2], [2, 9])
    assert (weights[0].astype(np.float32) > 0).all()


def test_winners_held_by_one_lane():
    """The 16 winners in one lane's registers (experts 32 j + c): that lane refills its cache every
    third round; with ties between its keys and other lanes' and across the cut."""
    logits = np.zeros((4, K3.experts), np.float32)
    logits[0, 0::32] = np.linspace(5.0, 2.0, 28)
    logits[1, 31::32] = 3.0  # 28 bit-equal winners in lane 31: the lowest 16 of them
    logits[2, 5::32] = 3.0
    logits[2, [6, 900 - 32 * 2]] = 3.0  # two more, in other lanes, tie with lane 5's
    logits[3, 0::32] = 4.0
    logits[3, 1] = 4.0
    ids, _ = check(logits, np.zeros(K3.experts))
    np.testing.assert_array_equal(ids[0], np.arange(16) * 32)
    np.testing.assert_array_equal(ids[1], np.arange(16) * 32 + 31)
    np.testing.assert_array_equal(ids[2], np.sort(np.r_[np.arange(28) * 32 + 5, 6, 836])[:16])
    np.testing.assert_array_equal(ids[3], np.sort(np.r_[np.arange(28) * 32, 1])[:16])


@pytest.mark.parametrize("direction", [1, -1])
def test_bias_makes_every_key_negative(direction):
    logits = np.zeros((2, K3.experts), np.float32)
    logits[1] = np.random.default_rng(4).normal(0, 1, K3.experts)
    bias = (-3.0 + direction * 0.001 * np.arange(K3.experts)).astype(np.float32)
    ids, _ = check(logits, bias)
    want = np.arange(16) if direction < 0 else K3.experts - 1 - np.arange(16)
    np.testing.assert_array_equal(ids[0], want)


@pytest.mark.parametrize("lane_weights", [False, True])
def test_weights_correctly_rounded_at_a_bf16_midpoint(lane_weights):
    """``test_route_kernel.ROUNDING_ROW`` (a weight within a float32 ulp of a bf16 midpoint) with 48
    more experts at -inf: summed in another order or divided by a reciprocal, it rounds down; the
    weights as scalars and one a lane."""
    cfg = mf.FrontConfig(hidden=1, experts=64, top_k=16, latent=1, shared=0, plan_block=1)
    logits = np.full((1, 64), -np.inf, np.float32)
    logits[0, :16] = ROUNDING_ROW
    ids, weights = check(logits, np.zeros(64), cfg,
                         config=mr.MosaicRouteConfig(lane_weights=lane_weights))
    np.testing.assert_array_equal(ids[0], np.arange(16))
    assert weights[0, 0] == np.asarray(0.06298828125, jnp.bfloat16)


# --- random and adversarial rows ---------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 37, 64])
def test_random_rows(batch):
    rng = np.random.default_rng(batch)
    logits = rng.normal(0, 2, (batch, K3.experts)).astype(np.float32)
    check(logits, rng.uniform(-0.05, 0.05, K3.experts).astype(np.float32))


@pytest.mark.parametrize("name", CONFIGS)
def test_other_shapes(name):
    """256, 384 and 1024 experts, top 8 and 32, a scale, top 6 without renormalize."""
    cfg = CONFIGS[name]
    logits, bias = adversarial_rows(np.random.default_rng(cfg.experts), 5, cfg.experts)
    check(logits, bias, cfg)


def test_adversarial_rows_and_the_dispatch_at_255():
    """255 rows of few values, NaN, +-inf, +-0.0 (``test_route_kernel.adversarial_rows``), with the
    dispatch order: 4080 slots, the last column step overlapping the one before."""
    logits, bias = adversarial_rows(np.random.default_rng(2024), 255, K3.experts)
    check(logits, bias, permute=True)


# --- the dispatch order ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "same"])
def test_dispatch_after_routing(kind):
    """``permute=True`` at B = 1, 3 (48 slots, padded to 64), 4 (64), 5 (80: the last block of
    slots overlaps the one before) and 37: ids, weights and the three outputs bit-equal."""
    rng = np.random.default_rng(len(kind))
    for batch in (1, 3, 4, 5, 37):
        logits, bias = rows_of_kind(kind, rng, batch, K3.experts)
        check(logits, bias, permute=True)


@pytest.mark.parametrize("name", ["e256_top8", "e1024_top32", "GLM_4_5"])
def test_dispatch_from_given_ids(name):
    """``permutation`` on adversarial ids (every row the same experts, the highest ones, a few
    experts shared by every row), at and around the 64-slot blocks; GLM-4.5's 160 experts, the last
    block of experts overlapping the one before."""
    cfg = {**CONFIGS, **FAMILIES}[name]
    rng = np.random.default_rng(7)
    for batch in (1, 7, 9, 65):
        ids = adversarial_ids(rng, batch, cfg)
        want = reference_routing.permutation(ids, cfg)
        assert_dispatch(ids, *want, cfg.experts)
        assert_each_bits_equal(interpret_permutation(ids, cfg=cfg), want)


# --- the routing families (SPEC 4.2, 4.3) -------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 37])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_random_rows(name, batch):
    """Each preset the kernel covers (Kimi-K3, DeepSeek-V3's groups, Kimi-K2, GLM-4.5, Qwen3's
    softmax) on random rows, bit-equal to the reference."""
    cfg = FAMILIES[name]
    rng = np.random.default_rng(batch)
    logits = rng.normal(0, 2, (batch, cfg.experts)).astype(np.float32)
    check(logits, rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32), cfg)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_adversarial_rows_and_dispatch(name):
    """33 rows of few values, NaN, +-inf and +-0.0 (``test_route_kernel.adversarial_rows``: ties at
    both levels), with the dispatch order."""
    cfg = FAMILIES[name]
    logits, bias = adversarial_rows(np.random.default_rng(len(name)), 33, cfg.experts)
    check(logits, bias, cfg, permute=True)


@pytest.mark.parametrize("name", [*GROUPED_SHAPES, *SOFTMAX_SHAPES])
def test_other_family_shapes(name):
    """Groups of 8, 2 and 64 experts, one group kept; softmax without renormalize, over 896 experts
    and with half the experts chosen: random and adversarial rows at B = 5."""
    cfg = {**GROUPED_SHAPES, **SOFTMAX_SHAPES}[name]
    rng = np.random.default_rng(cfg.experts + cfg.groups)
    logits, bias = adversarial_rows(rng, 5, cfg.experts)
    check(logits, bias, cfg)
    check(rng.normal(0, 2, (5, cfg.experts)), rng.uniform(-0.05, 0.05, cfg.experts), cfg)


DEEPSEEK = mf.configs.DEEPSEEK_V3


def test_group_edge_rows():
    """DeepSeek-V3 (8 groups of 32, 4 kept, top 8): a row of equal keys (the lowest groups and
    experts), two groups tied on their score (the lower kept) with experts tied inside, a group all
    NaN and one with a single number (their scores NaN, ranked last), a row all NaN, a row of -inf
    (the bias decides), +inf logits, and a masked expert above every kept one."""
    e, zero = DEEPSEEK.experts, np.zeros(DEEPSEEK.experts, np.float32)
    logits = np.full((8, e), -3.0, np.float32)
    logits[0] = 0.0
    logits[1, [32, 33, 96, 97, 160, 161]] = 2.0      # groups 1, 3, 5 tie; 3 more groups: 0, 2, 4
    logits[2, :32] = np.nan                          # group 0 NaN
    logits[2, 64] = 1.0
    logits[2, 65:96] = np.nan                        # group 2: one number, its score NaN
    logits[3] = np.nan
    logits[4] = -np.inf
    logits[5, [200, 7]] = np.inf
    logits[6, 0] = 9.0                               # group 0: one great key, then low ones...
    logits[6, [40, 41, 80, 81, 120, 121, 200, 201]] = 1.0  # ...four groups with two good keys
    logits[7, ::2] = 0.5
    ids, weights = check(logits, zero, DEEPSEEK)
    np.testing.assert_array_equal(ids[0], np.arange(8))
    np.testing.assert_array_equal(ids[1, :6], [32, 33, 96, 97, 160, 161])
    assert set(ids[1] // 32) <= {0, 1, 3, 5}          # groups 1, 3, 5 and the lowest of the rest
    assert not ({0, 2} & set(ids[2] // 32))
    np.testing.assert_array_equal(ids[3], np.arange(8))
    assert (weights[3].astype(np.float32) == 0).all()
    np.testing.assert_array_equal(ids[4], np.arange(8))
    assert (weights[4].astype(np.float32) == 0).all()
    bias = zero.copy()
    bias[[255, 100]] = 0.01                          # every sigmoid 0: the bias decides
    ids_inf, _ = check(logits[4:5], bias, DEEPSEEK)
    np.testing.assert_array_equal(ids_inf[0, :2], [100, 255])
    np.testing.assert_array_equal(ids[5, :2], [7, 200])
    assert 0 not in ids[6] and set(ids[6, :8]) == {40, 41, 80, 81, 120, 121, 200, 201}
    np.testing.assert_array_equal(ids[7], np.arange(0, 16, 2))


def test_softmax_edge_rows():
    """Qwen3-30B-A3B (128 experts, top 8): equal logits, ties across the cut, NaN sprinkled and a
    row all NaN, a row of -inf, a +inf logit (NaN probabilities weigh 0), -0.0 beside +0.0."""
    cfg = FAMILIES["QWEN3_30B_A3B"]
    logits = np.zeros((7, cfg.experts), np.float32)
    logits[1, 50:60] = 1.0
    logits[1, [3, 90]] = 2.0
    logits[2, ::3] = np.nan
    logits[3] = np.nan
    logits[4] = -np.inf
    logits[5, 77] = np.inf
    logits[6, 1::2] = -0.0
    ids, weights = check(logits, np.zeros(cfg.experts), cfg)
    np.testing.assert_array_equal(ids[0], np.arange(8))
    np.testing.assert_array_equal(ids[1], [3, 90, 50, 51, 52, 53, 54, 55])
    assert not (ids[2] % 3 == 0).any()
    np.testing.assert_array_equal(ids[3], np.arange(8))
    np.testing.assert_array_equal(ids[6], np.arange(0, 16, 2))
    for row in (3, 4, 5):
        assert (weights[row].astype(np.float32) == 0).all()
    np.testing.assert_array_equal(weights[0].astype(np.float32), np.full(8, 1 / 8, np.float32))


# --- the schedules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
def test_schedules(config):
    """Each schedule bit-equal to the reference at B = 7 (the last CTA part full where a CTA routes
    several rows): Kimi-K3 with one lane holding all winners, DeepSeek-V3 and Qwen3 on adversarial
    rows, Kimi-K2 and GLM-4.5 on random ones."""
    rng = np.random.default_rng(config.cached)
    logits = rng.normal(0, 2, (7, K3.experts)).astype(np.float32)
    logits[0, 0::32] = np.linspace(5.0, 2.0, 28)
    logits[1, 31::32] = 3.0
    check(logits, rng.uniform(-0.05, 0.05, K3.experts), K3, config=config)
    for name in ("DEEPSEEK_V3", "QWEN3_30B_A3B"):
        cfg = FAMILIES[name]
        check(*adversarial_rows(rng, 7, cfg.experts), cfg, config=config)
    for name in ("KIMI_K2", "GLM_4_5"):  # GLM-4.5's 160 experts: no split
        cfg = FAMILIES[name]
        check(rng.normal(0, 2, (7, cfg.experts)), rng.uniform(-0.05, 0.05, cfg.experts), cfg,
              config=dataclasses.replace(config, split=config.split and cfg.experts % 128 == 0))


GROUPED_CONFIGS = [DEEPSEEK, *GROUPED_SHAPES.values()]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_grouped_routing_never_leaves_the_kept_groups(data):
    """Any float32 logits (NaN and infinities included) and biases, for grouped shapes: the kernel's
    ids are the reference's, and each lies within the oracle's kept groups of its row."""
    cfg = data.draw(st.sampled_from(GROUPED_CONFIGS))
    rows = data.draw(st.sampled_from([1, 2]))
    values = st.floats(width=32, allow_nan=True, allow_infinity=True)
    logits = data.draw(hnp.arrays(np.float32, (rows, cfg.experts), elements=values))
    bias = data.draw(hnp.arrays(np.float32, (cfg.experts,),
                                elements=st.floats(-1, 1, width=32, allow_nan=False)))
    check(logits, bias, cfg)


# --- what the kernels cover; errors ------------------------------------------------------------------


def test_covers_and_errors():
    assert_argument_errors(mr.route)
    bias = jnp.zeros((K3.experts,), jnp.float32)
    with pytest.raises(ValueError, match="cfg must be a FrontConfig"):
        mr.route(jnp.zeros((2, 896), jnp.float32), bias, None)
    e100 = mf.FrontConfig(hidden=256, experts=100, top_k=6, latent=128, shared=0)
    with pytest.raises(NotImplementedError, match="experts=100 is not 32 \\* n with n >= 2"):
        mr.route(jnp.zeros((1, 100), jnp.float32), jnp.zeros((100,), jnp.float32), e100)
    e32 = mf.FrontConfig(hidden=256, experts=32, top_k=6, latent=128, shared=0)
    with pytest.raises(NotImplementedError, match="experts=32 is not 32 \\* n with n >= 2"):
        mr.route(jnp.zeros((1, 32), jnp.float32), jnp.zeros((32,), jnp.float32), e32)
    with pytest.raises(NotImplementedError, match="blocks of 64: experts=32 is fewer"):
        mr.permutation(jnp.zeros((1, 6), jnp.int32), e32)
    big = jnp.zeros((mr.MAX_PERMUTE_ROWS + 1, 896), jnp.float32)
    mr.covers(big, bias, K3)
    with pytest.raises(NotImplementedError, match="covers up to 256 rows, got B=257"):
        mr.route(big, bias, K3, permute=True)
    with pytest.raises(ValueError, match=r"ids must be \[B, top_k=16\] int32"):
        mr.permutation(jnp.zeros((2, 16), jnp.float32), K3)
    with pytest.raises(ValueError, match="ids is an empty batch"):
        mr.permutation(jnp.zeros((0, 16), jnp.int32), K3)


def test_families_covered_and_schedule_errors():
    """Mixtral's 8 experts are not covered; the split needs runs of 32 experts for every warp
    (GLM-4.5's 160 are not); a schedule that is not a ``MosaicRouteConfig`` or whose fields are out
    of range is a ``ValueError`` naming the field and the value."""
    assert set(FAMILIES) == set(mf.configs.PRESETS) - {"MIXTRAL_8X7B"}
    mixtral = mf.configs.MIXTRAL_8X7B
    with pytest.raises(NotImplementedError, match="experts=8 is not 32 \\* n with n >= 2"):
        mr.route(jnp.zeros((1, 8), jnp.float32), jnp.zeros((8,), jnp.float32), mixtral)
    glm = FAMILIES["GLM_4_5"]
    logits, bias = jnp.zeros((1, 160), jnp.float32), jnp.zeros((160,), jnp.float32)
    mr.covers(logits, bias, glm, config=mr.MosaicRouteConfig())
    with pytest.raises(NotImplementedError, match="experts=160 is not a multiple of 128"):
        mr.route(logits, bias, glm, config=mr.MosaicRouteConfig(split=True))
    qwen = FAMILIES["QWEN3_30B_A3B"]  # 128 experts; softmax has no keys to split either way
    mr.covers(jnp.zeros((1, 128), jnp.float32), jnp.zeros((128,), jnp.float32), qwen,
              config=mr.MosaicRouteConfig(split=True))
    with pytest.raises(ValueError, match="config must be a MosaicRouteConfig, got"):
        mr.route(logits, bias, glm, config=dict(cached=3))
    lanes = mr.MosaicRouteConfig(lane_weights=True)
    mr.covers(logits, bias, glm, config=lanes)
    for k in (6, 64):
        cfg = dataclasses.replace(K3, top_k=k)
        with pytest.raises(NotImplementedError, match=f"a power of two of them up to 32: top_k={k}"):
            mr.route(jnp.zeros((1, 896), jnp.float32), jnp.zeros((896,), jnp.float32), cfg,
                     config=lanes)
    for field, value, message in (
            ("warpgroups", 0, "warpgroups must be an int from 1 to 4, got 0"),
            ("warpgroups", 5, "warpgroups must be an int from 1 to 4, got 5"),
            ("steps", 65, "steps must be an int from 1 to 64, got 65"),
            ("cached", 9, "cached must be an int from 1 to 8, got 9"),
            ("cached", True, "cached must be an int from 1 to 8, got True"),
            ("unroll", 0, "unroll must be an int from 1 to 64, got 0"),
            ("split", 1, "split must be a bool, got 1"),
            ("lane_weights", None, "lane_weights must be a bool, got None")):
        with pytest.raises(ValueError, match=f"MosaicRouteConfig.{message}"):
            mr.MosaicRouteConfig(**{field: value})
    assert mr.MosaicRouteConfig(warpgroups=2, steps=3).rows == 6
    assert mr.MosaicRouteConfig(split=True, unroll=2).name == "w1s1c3u2x"
    assert mr.MosaicRouteConfig(lane_weights=True).name == "w1s1c3u1l"


def test_bytes():
    assert rk.route_bytes(1, 896, 16) == 4 * 896 + 4 * 896 + 4 * 16 + 6 * 16
    assert rk.route_bytes(2, 128, 8, bias=False) == 2 * 4 * 128 + 2 * 4 * 8 + 2 * 6 * 8
    # 64 slots (B = 4): one step of columns, 14 blocks of experts (3 of GLM-4.5's 160).
    assert mr.permute_bytes(4, 896, 16) == 4 * 64 * (1 + 14) + 12 * 64 + 4 * 896
    assert mr.permute_bytes(8, 160, 8) == 4 * 64 * (1 + 3) + 12 * 64 + 4 * 160
    assert mr.permute_bytes(1, 896, 16) == 4 * 64 * (1 + 14) + 12 * 16 + 4 * 896


# --- lowering for an H200 ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_lowers_for_h200(batch):
    """One Mosaic GPU kernel (two with the dispatch order), launched with PDL, nothing on Triton, no
    sort, top_k, gather, division or sigmoid left to XLA; a pad of the ids only below 64 slots."""
    logits = jnp.zeros((batch, K3.experts), jnp.float32)
    bias = jnp.zeros((K3.experts,), jnp.float32)
    for permute in (False, True):
        text = lower_for_h200(lambda l, b: mr.route(l, b, K3, permute=permute), logits, bias)
        assert text.count("@mosaic_gpu_v2") == 1 + permute, (batch, permute)
        assert text.count("mosaic_gpu.uses_pdl") == 1 + permute
        assert "triton" not in text
        for op in ("stablehlo.sort", "top_k", "stablehlo.gather", "stablehlo.divide", "logistic",
                   "stablehlo.scatter"):
            assert op not in text, (batch, permute, op)
        assert text.count("stablehlo.pad") == (1 if permute and batch * 16 < 64 else 0)


def test_other_shapes_lower_for_h200():
    for cfg in CONFIGS.values():
        logits = jnp.zeros((3, cfg.experts), jnp.float32)
        bias = jnp.zeros((cfg.experts,), jnp.float32)
        text = lower_for_h200(lambda l, b: mr.route(l, b, cfg), logits, bias)
        assert text.count("@mosaic_gpu_v2") == 1


def assert_one_kernel_for_h200(cfg, batch, config=None, permute=False):
    """``route`` lowers for an H200 to one Mosaic GPU kernel (two with the order) and nothing of
    the routing left to XLA: no sort, top_k, gather, division, exponential or logistic."""
    logits = jnp.zeros((batch, cfg.experts), jnp.float32)
    bias = jnp.zeros((cfg.experts,), jnp.float32)
    text = lower_for_h200(lambda l, b: mr.route(l, b, cfg, config=config, permute=permute),
                          logits, bias)
    assert text.count("@mosaic_gpu_v2") == 1 + permute, (cfg, batch, config)
    assert "triton" not in text
    for op in ("stablehlo.sort", "top_k", "stablehlo.gather", "stablehlo.divide", "logistic",
               "stablehlo.exponential", "stablehlo.reduce"):
        assert op not in text, (cfg, batch, config, op)


@pytest.mark.parametrize("name", [*FAMILIES, *GROUPED_SHAPES, *SOFTMAX_SHAPES])
def test_families_lower_for_h200(name):
    cfg = {**FAMILIES, **GROUPED_SHAPES, **SOFTMAX_SHAPES}[name]
    for batch in (1, 37):
        assert_one_kernel_for_h200(cfg, batch, permute=batch == 37 and cfg.experts >= 64)


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
def test_schedules_lower_for_h200(config):
    for name in ("KIMI_K3", "DEEPSEEK_V3", "QWEN3_30B_A3B"):
        assert_one_kernel_for_h200(FAMILIES[name], 7, config)


# --- on the GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_matches_xla_reference():
    """``test_route_kernel.compare_with_xla_on_gpu`` (100,000 random rows and the edge rows against
    the XLA reference on the same device, near ties apart), with the dispatch order of every batch
    bit-equal to the reference's from the kernel's ids."""
    dispatch = jax.jit(lambda ids: reference_routing.permutation(ids, K3))

    def same_dispatch(outputs):
        assert_each_bits_equal(outputs[2:], dispatch(outputs[0]))

    kernel = jax.jit(lambda l, b: mr.route(l, b, K3, permute=True))
    assert_edge_ids(compare_with_xla_on_gpu(kernel, K3, same_dispatch))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 64, 256])
def test_gpu_dispatch_bit_equal_from_given_ids(batch):
    """``permutation`` on the GPU on adversarial ids, bit-equal to the reference."""
    ids = adversarial_ids(np.random.default_rng(batch), batch, K3)
    assert_each_bits_equal(jax.jit(lambda i: mr.permutation(i, K3))(ids),
                      reference_routing.permutation(ids, K3))


def family_edge_rows(experts):
    """Rows of genuine ties and specials for any expert count (bias zero): equal keys, +-0.0, all
    NaN, NaN in half, +-inf, all -inf, the winners at the top ids, and few values."""
    rows = np.zeros((8, experts), np.float32)
    rows[1, 1::2] = -0.0
    rows[2] = np.nan
    rows[3, : experts // 2] = np.nan
    rows[3, experts // 2:] = np.random.default_rng(0).normal(0, 1, experts - experts // 2)
    rows[4, [experts - 1, 7]] = np.inf
    rows[4, 1:3] = -np.inf
    rows[5] = -np.inf
    rows[6, experts - 40:] = 5.0
    rows[7] = np.array([0.0, 1.0, -1.0, 2.5], np.float32)[np.arange(experts) % 4]
    return rows


def near_tie_rows(logits, bias, cfg):
    """Rows where a sigmoid one ulp away could move an id (random rows, so bit-equal keys of
    different logits count): the reference's keys on the device, within ``CLEAR_ULPS`` of each
    other between ranks 0 and ``K`` among the kept groups' experts, or with groups, the group
    scores at the cut (ranks ``topk_groups - 1`` and ``topk_groups``). None with softmax: its keys
    are the logits."""
    if cfg.scoring == "softmax":
        return np.zeros(len(logits), bool)
    keys = jax.nn.sigmoid(logits) + bias
    ordered = np.asarray(reference_routing.ordered_key(keys)).astype(np.int64)
    if cfg.topk_groups < cfg.groups:
        scores = reference_routing.ordered_key(reference_routing.group_scores(keys, cfg))
        scores = -np.sort(-np.asarray(scores).astype(np.int64), axis=1)
        near = scores[:, cfg.topk_groups - 1] - scores[:, cfg.topk_groups] <= CLEAR_ULPS
        kept = np.asarray(reference_routing.kept_groups(keys, cfg))
        mask = np.zeros(ordered.shape, bool)
        for g in range(cfg.topk_groups):
            mask |= (np.arange(cfg.experts) // cfg.experts_per_group)[None] == kept[:, g:g + 1]
        ordered = np.where(mask, ordered, -1)
    else:
        near = np.zeros(len(logits), bool)
    top = -np.sort(-ordered, axis=1)[:, :cfg.top_k + 1]
    return near | ((top[:, :-1] - top[:, 1:]) <= CLEAR_ULPS).any(axis=1)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_family_matches_xla_reference(name):
    """Each family on the GPU against the XLA reference on the same device: 20,480 random rows,
    the edge rows and adversarial rows; ids equal on every row without a near tie (every row with
    softmax), weights within one bf16 ulp where the ids agree, never a NaN weight or a repeated id,
    the dispatch order bit-equal to the reference's of the kernel's ids. Bits equal the reference's
    wherever Mosaic's ``exp`` equals XLA's (``test_gpu_exp_and_sigmoid_match_xla``)."""
    cfg = FAMILIES[name]
    kernel = jax.jit(lambda l, b: mr.route(l, b, cfg, permute=True))
    xla = jax.jit(lambda l, b: reference.route(l, b, cfg))
    dispatch = jax.jit(lambda ids: reference_routing.permutation(ids, cfg))
    rng = np.random.default_rng(11)
    bias = jnp.asarray(rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32))
    zero = jnp.zeros(cfg.experts, jnp.float32)
    batches = [(jnp.asarray(family_edge_rows(cfg.experts)), zero, False),
               (*map(jnp.asarray, adversarial_rows(rng, 256, cfg.experts)), False)]
    batches += [(jnp.asarray(rng.normal(0, 2, (256, cfg.experts)).astype(np.float32)), bias, True)
                for _ in range(80)]
    clear_rows = 0
    for logits, row_bias, random_rows in batches:
        got = kernel(logits, row_bias)
        ids, weights = map(np.asarray, got[:2])
        ref_ids, ref_weights = map(np.asarray, xla(logits, row_bias))
        assert_valid(ids, weights, cfg.experts)
        assert_each_bits_equal(got[2:], dispatch(got[0]))
        clear = ~near_tie_rows(logits, row_bias, cfg) if random_rows else np.ones(len(ids), bool)
        np.testing.assert_array_equal(ids[clear], ref_ids[clear])
        same = (ids == ref_ids).all(axis=1)
        assert oracle.bf16_ulp_distance(weights[same], ref_weights[same]).max(initial=0) <= 1
        clear_rows += int(clear.sum()) if random_rows else 0
    assert clear_rows >= 0.98 * 80 * 256, clear_rows


@pytest.mark.gpu
@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
def test_gpu_schedules_bit_equal_to_the_default(config):
    """Each schedule on the GPU returns the default schedule's bits (the same operations on each
    row, whatever the rows a CTA holds or the cache), for Kimi-K3, DeepSeek-V3 and Qwen3 at B = 7
    and 64 on random and adversarial rows."""
    rng = np.random.default_rng(5)
    for name in ("KIMI_K3", "DEEPSEEK_V3", "QWEN3_30B_A3B"):
        cfg = FAMILIES[name]
        default = jax.jit(lambda l, b: mr.route(l, b, cfg))
        scheduled = jax.jit(lambda l, b: mr.route(l, b, cfg, config=config))
        for batch in (7, 64):
            for logits, bias in (adversarial_rows(rng, batch, cfg.experts),
                                 (rng.normal(0, 2, (batch, cfg.experts)).astype(np.float32),
                                  rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32))):
                logits, bias = jnp.asarray(logits), jnp.asarray(bias)
                assert_each_bits_equal(scheduled(logits, bias), default(logits, bias))


@pytest.mark.gpu
def test_gpu_exp_and_sigmoid_match_xla():
    """What the kernel's bits rest on, on the GPU: Mosaic GPU's ``exp`` (``math.exp``) and the
    kernel's sigmoid (``1 / (1 + exp(-x))``, correctly rounded division) against XLA's ``exp`` and
    ``jax.nn.sigmoid`` over 2^20 floats (every exponent, both signs, NaN and infinities): where this
    fails the routing weights may differ from the reference's in the last bf16 bit and ids between
    keys a few ulps apart (SPEC section 4's exactness), as ``pallas/route/mosaic.py`` says."""
    bits = np.random.default_rng(0).integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()
    x[:4] = [np.inf, -np.inf, np.nan, -0.0]
    x = jnp.asarray(x.reshape(-1, mr.LANES, mr.LANES))

    def body(x_ref, exp_ref, sigmoid_ref):
        v = plgpu.load(x_ref, layout=mr.ROW, optimized=False)
        exp_ref[...] = jnp.exp(v)
        sigmoid_ref[...] = mr._sigmoid(v, False)

    shape = jax.ShapeDtypeStruct(x.shape[1:], jnp.float32)
    kernel = jax.jit(jax.vmap(plgpu.kernel(body, out_type=(shape, shape), grid=(1,),
                                           grid_names=("cta",))))
    got = kernel(x)
    want = jax.jit(lambda v: (jnp.exp(v), jax.nn.sigmoid(v)))(x)
    for g, w in zip(got, want):  # NaN payloads aside
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(g[~np.isnan(g)].view(np.uint32),
                                      w[~np.isnan(w)].view(np.uint32))
