"""The Mosaic GPU routing kernels (``pallas/route/mosaic.py``): interpret mode bit-equal to the reference
on SPEC section 4's edge cases, on random and adversarial rows at B = 1, 3, 37, 64, 255 and on other
shapes, weights correctly rounded on a row at a bf16 midpoint, the dispatch order of SPEC 4.1 (after
routing and from given ids, below, at and past 64 slots); what it does not cover; lowering for an H200
from the CPU host; on a GPU against the XLA reference on the same device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.reference import routing as reference_routing
from moe_front_jax.pallas.route import mosaic as mr
from h200 import lower_for_h200
from test_permute import adversarial_ids, assert_bits_equal, assert_dispatch, rows_of
from test_route_kernel import (
    ROUNDING_ROW, adversarial_rows, assert_argument_errors, assert_edge_ids, assert_valid,
    compare_with_xla_on_gpu, edge_rows, oracle_clear_rows)
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


@functools.partial(jax.jit, static_argnames=("cfg", "permute"))
def interpret(logits, bias, *, cfg, permute=False):
    return mr.route(logits, bias, cfg, interpret=True, permute=permute)


@functools.partial(jax.jit, static_argnames="cfg")
def interpret_permutation(ids, *, cfg):
    return mr.permutation(ids, cfg, interpret=True)


reference_route = jax.jit(reference.route, static_argnums=2, static_argnames="permute")


def check(logits, bias, cfg=K3, permute=False):
    """Interpret mode against the reference, bit for bit (on the CPU the kernel's sigmoid, tree sum
    and division are the reference's), and against the float64 oracle's ids on rows without a near
    tie (weights within a bf16 ulp where the ids agree); returns ``(ids, weights)`` as numpy."""
    logits = jnp.asarray(logits, jnp.float32)
    bias = jnp.asarray(bias, jnp.float32)
    got = interpret(logits, bias, cfg=cfg, permute=permute)
    want = reference_route(logits, bias, cfg, permute=permute)
    assert_bits_equal(got, want)
    ids, weights = np.asarray(got[0]), np.asarray(got[1])
    assert_valid(ids, weights, cfg.experts)
    if permute:
        assert_dispatch(ids, *got[2:], cfg.experts)
    want_ids, want_weights = oracle.route(np.asarray(logits), np.asarray(bias), cfg.top_k,
                                          cfg.routed_scaling_factor, cfg.renormalize)
    clear = oracle_clear_rows(logits, bias, cfg.top_k)
    np.testing.assert_array_equal(ids[clear], want_ids[clear])
    same = (ids == want_ids).all(axis=1)
    assert oracle.bf16_ulp_distance(weights[same], want_weights[same]).max(initial=0) <= 1
    return ids, weights


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


def test_weights_correctly_rounded_at_a_bf16_midpoint():
    """``test_route_kernel.ROUNDING_ROW`` (a weight within a float32 ulp of a bf16 midpoint) with 16
    more experts at -inf: summed in another order or divided by a reciprocal, it rounds down."""
    cfg = mf.FrontConfig(hidden=1, experts=32, top_k=16, latent=1, shared=0, plan_block=1)
    logits = np.full((1, 32), -np.inf, np.float32)
    logits[0, :16] = ROUNDING_ROW
    ids, weights = check(logits, np.zeros(32), cfg)
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
        logits, bias = rows_of(kind, rng, batch, K3.experts)
        check(logits, bias, permute=True)


@pytest.mark.parametrize("name", ["e256_top8", "e1024_top32"])
def test_dispatch_from_given_ids(name):
    """``permutation`` on adversarial ids (every row the same experts, the highest ones, a few
    experts shared by every row), at and around the 64-slot blocks."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(7)
    for batch in (1, 7, 9, 65):
        ids = adversarial_ids(rng, batch, cfg)
        want = reference_routing.permutation(ids, cfg)
        assert_dispatch(ids, *want, cfg.experts)
        assert_bits_equal(interpret_permutation(ids, cfg=cfg), want)


# --- what the kernels cover; errors ------------------------------------------------------------------


def test_covers_and_errors():
    assert_argument_errors(mr.route)
    bias = jnp.zeros((K3.experts,), jnp.float32)
    with pytest.raises(ValueError, match="cfg must be a FrontConfig"):
        mr.route(jnp.zeros((2, 896), jnp.float32), bias, None)
    for extra in (dict(groups=8, topk_groups=4), dict(scoring="softmax", bias=False)):
        grouped = dataclasses.replace(K3, **extra)
        with pytest.raises(NotImplementedError, match="ranks sigmoid \\+ bias over all experts"):
            mr.route(jnp.zeros((1, 896), jnp.float32), bias, grouped)
    e100 = mf.FrontConfig(hidden=256, experts=100, top_k=6, latent=128, shared=0)
    with pytest.raises(NotImplementedError, match="experts=100 is not a multiple of 32"):
        mr.route(jnp.zeros((1, 100), jnp.float32), jnp.zeros((100,), jnp.float32), e100)
    e96 = mf.FrontConfig(hidden=256, experts=96, top_k=6, latent=128, shared=0)
    logits96, bias96 = jnp.zeros((1, 96), jnp.float32), jnp.zeros((96,), jnp.float32)
    mr.covers(logits96, bias96, e96)
    with pytest.raises(NotImplementedError, match="experts=96 is not a multiple of 64"):
        mr.route(logits96, bias96, e96, permute=True)
    big = jnp.zeros((mr.MAX_PERMUTE_ROWS + 1, 896), jnp.float32)
    mr.covers(big, bias, K3)
    with pytest.raises(NotImplementedError, match="covers up to 256 rows, got B=257"):
        mr.route(big, bias, K3, permute=True)
    with pytest.raises(ValueError, match=r"ids must be \[B, top_k=16\] int32"):
        mr.permutation(jnp.zeros((2, 16), jnp.float32), K3)
    with pytest.raises(ValueError, match="ids is an empty batch"):
        mr.permutation(jnp.zeros((0, 16), jnp.int32), K3)


def test_bytes():
    assert mr.route_bytes(1, 896, 16) == 4 * 896 + 4 * 896 + 4 * 16 + 6 * 16
    # 64 slots (B = 4): one step of columns, 14 blocks of experts.
    assert mr.permute_bytes(4, 896, 16) == 4 * 64 * (1 + 14) + 12 * 64 + 4 * 896
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


# --- on the GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_matches_xla_reference():
    """``test_route_kernel.compare_with_xla_on_gpu`` (100,000 random rows and the edge rows against
    the XLA reference on the same device, near ties apart), with the dispatch order of every batch
    bit-equal to the reference's from the kernel's ids."""
    dispatch = jax.jit(lambda ids: reference_routing.permutation(ids, K3))

    def same_dispatch(outputs):
        assert_bits_equal(outputs[2:], dispatch(outputs[0]))

    kernel = jax.jit(lambda l, b: mr.route(l, b, K3, permute=True))
    assert_edge_ids(compare_with_xla_on_gpu(kernel, K3, same_dispatch))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 64, 256])
def test_gpu_dispatch_bit_equal_from_given_ids(batch):
    """``permutation`` on the GPU on adversarial ids, bit-equal to the reference."""
    ids = adversarial_ids(np.random.default_rng(batch), batch, K3)
    assert_bits_equal(jax.jit(lambda i: mr.permutation(i, K3))(ids),
                      reference_routing.permutation(ids, K3))
