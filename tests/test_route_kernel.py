"""The Pallas routing kernel: interpret mode against the reference and the numpy oracle on every SPEC
edge case and on random rows, a seeded property loop over thousands of adversarial rows, weights
correctly rounded (a row at a bf16 midpoint, through ``route`` and ``route_collect``, and 73,728
random rows bit-equal to the reference), the schedule table, lowering for an H200 from the CPU host,
and on a GPU against the XLA reference on the same device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import registry, reference
from moe_front_jax.reference import mailbox as reference_mailbox
from moe_front_jax.pallas.route import kernel as rt
from moe_front_jax.pallas.route_collect import kernel as rc
from h200 import lower_for_h200
from route_cases import (ROUNDING_ROW, adversarial_rows, assert_argument_errors, assert_edge_ids,
                         assert_valid, compare_with_xla_on_gpu, oracle_clear_rows)
import oracle

K3 = mf.KIMI_K3
CONFIGS = {
    "k3": K3,
    "e256_top8": mf.FrontConfig(hidden=256, experts=256, top_k=8, latent=128, shared=0),
    "e384_top8_scaled": mf.FrontConfig(
        hidden=256, experts=384, top_k=8, latent=128, shared=0, routed_scaling_factor=2.5
    ),
    "e1024_top32": mf.FrontConfig(hidden=256, experts=1024, top_k=32, latent=128, shared=0),
    "e100_top6_plain": mf.FrontConfig(
        hidden=256, experts=100, top_k=6, latent=128, shared=0, routed_scaling_factor=2.5,
        renormalize=False,
    ),
}


@functools.partial(jax.jit, static_argnames=("cfg", "config"))
def interpret(logits, bias, *, cfg, config=None):
    return rt.route(logits, bias, cfg, interpret=True, config=config)


reference_route = jax.jit(reference.route, static_argnums=2)


def check(logits, bias, cfg=K3, config=None, select=None):
    """The interpret kernel against the reference (ids and weight bits equal: on the CPU the kernel's
    sigmoid, tree sum and division are the reference's) and the float64 oracle (ids equal on rows
    whose oracle keys have no near tie among the top k + 1, weights within one bf16 ulp where the ids
    agree: the oracle's sigmoid is correctly rounded, XLA's may be an ulp off); returns (ids, weights)
    as numpy. ``select``, if given, replaces the schedule's selection (``config``, else the picked
    one, which is the groups selection on every device)."""
    logits = jnp.asarray(logits, jnp.float32)
    bias = jnp.asarray(bias, jnp.float32)
    if select is not None:
        config = config or rt.pick_config(logits.shape[0], cfg.experts, cfg.top_k)
        config = dataclasses.replace(config, select=select)
    if config is not None and config.select == "groups":
        lanes = rt.next_power_of_2(cfg.experts)
        assert rt.group_plan(lanes, cfg.experts, cfg.top_k, config.group) is not None
    ids, weights = interpret(logits, bias, cfg=cfg, config=config)
    ids, weights = np.asarray(ids), np.asarray(weights)
    assert ids.dtype == np.int32 and ids.shape == (logits.shape[0], cfg.top_k)
    assert weights.dtype == jnp.bfloat16 and weights.shape == ids.shape
    ref_ids, ref_weights = reference_route(logits, bias, cfg)
    np.testing.assert_array_equal(ids, np.asarray(ref_ids))
    np.testing.assert_array_equal(weights.view(np.uint16), np.asarray(ref_weights).view(np.uint16))
    want_ids, want_weights = oracle.route(
        np.asarray(logits), np.asarray(bias), cfg.top_k, cfg.routed_scaling_factor, cfg.renormalize
    )
    clear = oracle_clear_rows(logits, bias, cfg.top_k)
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(ids[clear], want_ids[clear])
    same = (ids == want_ids).all(axis=1)
    assert oracle.bf16_ulp_distance(weights[same], want_weights[same]).max(initial=0) <= 1
    assert_valid(ids, weights, cfg.experts)
    return ids, weights


@pytest.fixture(params=rt.SELECTS)
def select(request):
    """Each selection of the kernel: ``select_ranked`` (argmax rounds) and ``select_grouped``."""
    return request.param


# --- SPEC edge cases ---------------------------------------------------------------------------------


def test_bit_equal_keys_tie_to_lower_id(select):
    logits = np.full((3, K3.experts), 0.3, np.float32)
    logits[1, ::7] = 0.9  # 128 bit-equal winners: the lowest 16 of them
    logits[2, 880:] = 5.0  # exactly 16 winners at the top ids, and 880 bit-equal losers
    ids, weights = check(logits, np.zeros(K3.experts), select=select)
    np.testing.assert_array_equal(ids[0], np.arange(16))
    np.testing.assert_array_equal(ids[1], np.arange(16) * 7)
    np.testing.assert_array_equal(ids[2], np.arange(880, 896))
    np.testing.assert_array_equal(weights.astype(np.float32), np.full((3, 16), 1 / 16, np.float32))


def test_ties_straddling_the_cut(select):
    """Five experts tie at the 16th key: the lowest three of them fill ranks 13-15."""
    logits = np.zeros((1, K3.experts), np.float32)
    logits[0, 100:113] = np.linspace(3.0, 2.0, 13)  # ranks 0..12, distinct
    logits[0, [800, 40, 600, 41, 5]] = 1.0  # bit-equal: ranks 13..15 are 5, 40, 41
    ids, _ = check(logits, np.zeros(K3.experts), select=select)
    np.testing.assert_array_equal(ids[0, :13], np.arange(100, 113))
    np.testing.assert_array_equal(ids[0, 13:], [5, 40, 41])


def test_all_equal_row_and_zero_signs(select):
    logits = np.zeros((2, K3.experts), np.float32)
    logits[0, 1::2] = -0.0  # sigmoid(-0.0) == sigmoid(+0.0): every key is bit-equal
    # Keys of -0.0 and +0.0: sigmoid(-40) + (-sigmoid(-40)) is +0.0; a bias of -0.0 on a zero score
    # (sigmoid(-inf)) gives +0.0 + -0.0 = +0.0 too. Equal keys, so ids in order.
    logits[1] = -np.inf
    bias = np.zeros(K3.experts, np.float32)
    bias[::3] = -0.0
    ids, weights = check(logits, bias, select=select)
    np.testing.assert_array_equal(ids, np.tile(np.arange(16), (2, 1)))
    np.testing.assert_array_equal(weights.astype(np.float32)[0], np.full(16, 1 / 16, np.float32))
    np.testing.assert_array_equal(weights.astype(np.float32)[1], np.zeros(16, np.float32))


def test_negative_zero_bias_on_a_zero_score_ties_with_positive_zero(select):
    """A key is never -0.0: a zero score plus a -0.0 bias is +0.0, bit-equal to the +0.0 keys."""
    logits = np.full((1, K3.experts), -np.inf, np.float32)  # sigmoid 0.0: keys = 0.0 + bias
    bias = np.full(K3.experts, -1.0, np.float32)
    bias[3] = -0.0
    bias[500:520] = 0.0
    ids, _ = check(logits, bias, select=select)
    np.testing.assert_array_equal(ids[0], [3] + list(range(500, 515)))
    logits[0, 3] = -0.0  # sigmoid(-0.0) = 0.5: the top
    ids, _ = check(logits, bias, select=select)
    np.testing.assert_array_equal(ids[0], [3] + list(range(500, 515)))
    ids, _ = check(logits[:, ::-1].copy(), bias[::-1].copy(), select=select)
    np.testing.assert_array_equal(ids[0], [892] + list(range(376, 391)))


def test_nan_logits_rank_lowest(select):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (2, K3.experts)).astype(np.float32)
    logits[0, :100] = np.nan
    logits[1, :] = np.nan
    logits[1, [500, 40, 890, 7, 300]] = [3.0, 2.0, 1.0, 0.0, -1.0]
    ids, weights = check(logits, np.zeros(K3.experts), select=select)
    assert (ids[0] >= 100).all()
    np.testing.assert_array_equal(ids[1, :5], [500, 40, 890, 7, 300])
    np.testing.assert_array_equal(ids[1, 5:], [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11])
    assert (weights[1, 5:].astype(np.float32) == 0).all()


def test_all_nan_rows(select):
    logits = np.full((3, K3.experts), np.nan, np.float32)
    logits[2, 0] = -np.nan  # a negative NaN is a NaN too
    bias = np.zeros(K3.experts, np.float32)
    bias[:4] = np.nan
    ids, weights = check(logits, bias, select=select)
    np.testing.assert_array_equal(ids, np.tile(np.arange(16), (3, 1)))
    np.testing.assert_array_equal(weights.astype(np.float32), np.zeros((3, 16), np.float32))


def test_nan_logits_weigh_zero_without_renormalize(select):
    cfg = CONFIGS["e100_top6_plain"]  # weights = bf16(s * 2.5), no division
    logits = np.full((2, cfg.experts), np.nan, np.float32)
    logits[1, [70, 20, 90]] = [2.0, 0.0, -3.0]
    ids, weights = check(logits, np.zeros(cfg.experts, np.float32), cfg, select=select)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3, 4, 5], [70, 20, 90, 0, 1, 2]])
    want = (oracle.sigmoid32(np.float32([2.0, 0.0, -3.0])) * np.float32(2.5)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(weights[1, :3].view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(weights[0].astype(np.float32), np.zeros(6, np.float32))
    np.testing.assert_array_equal(weights[1, 3:].astype(np.float32), np.zeros(3, np.float32))


def test_nan_bias_ranks_lowest_but_weighs_its_sigmoid(select):
    logits = np.zeros((1, K3.experts), np.float32)
    logits[0, 3] = 10.0
    bias = np.zeros(K3.experts, np.float32)
    bias[3] = np.nan
    ids, _ = check(logits, bias, select=select)
    assert 3 not in ids[0]
    # With too few numbers, the NaN-keyed expert is chosen (lowest) and weighs its sigmoid.
    bias[:] = np.nan
    bias[[9, 2]] = 0.0
    ids, weights = check(logits, bias, select=select)
    np.testing.assert_array_equal(ids[0, :2], [2, 9])
    assert 3 in ids[0] and (weights[0].astype(np.float32) > 0).all()


def test_infinities(select):
    logits = np.zeros((2, K3.experts), np.float32)
    logits[0, [300, 7]] = np.inf  # sigmoid 1.0: bit-equal keys, 7 first
    logits[0, 1:3] = -np.inf
    logits[1] = -np.inf
    logits[1, 50] = np.inf
    bias = np.zeros(K3.experts, np.float32)
    ids, _ = check(logits, bias, select=select)
    np.testing.assert_array_equal(ids[0, :3], [7, 300, 0])
    assert 1 not in ids[0] and 2 not in ids[0]
    np.testing.assert_array_equal(ids[1], [50] + list(range(15)))
    # Infinite biases: +inf keys first (lower id on the tie), -inf keys last but above NaN.
    bias[[600, 4]] = np.inf
    bias[:4] = -np.inf
    logits[1, 5:] = np.nan
    ids, _ = check(logits, bias, select=select)
    np.testing.assert_array_equal(ids[0, :4], [4, 600, 7, 300])
    # Row 1: 4's key is +inf, 0..3's -inf (above the NaN keys of every other expert, 600's too).
    np.testing.assert_array_equal(ids[1], [4, 0, 1, 2, 3] + list(range(5, 16)))


@pytest.mark.parametrize("direction", [1, -1])
def test_bias_makes_every_key_negative(direction, select):
    logits = np.zeros((2, K3.experts), np.float32)
    logits[1] = np.random.default_rng(4).normal(0, 1, K3.experts)
    bias = (-3.0 + direction * 0.001 * np.arange(K3.experts)).astype(np.float32)
    ids, _ = check(logits, bias, select=select)
    want = np.arange(16) if direction < 0 else K3.experts - 1 - np.arange(16)
    np.testing.assert_array_equal(ids[0], want)


# --- random rows, other configs, schedules -----------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("batch", [1, 3, 37, 255])
def test_random_rows(name, batch, select):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(batch * 1000 + cfg.experts)
    logits = rng.normal(0, 2, (batch, cfg.experts)).astype(np.float32)
    bias = rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32)
    # The shipped schedule (one row a program) at small B; blocks of rows, with a ragged last block.
    config = rt.RouteConfig(1, 4, select) if batch < 37 else rt.RouteConfig(16, 4, select)
    check(logits, bias, cfg, config)


# --- correctly rounded weights in interpret mode -----------------------------------------------------

E16 = mf.FrontConfig(hidden=1, experts=16, top_k=16, latent=1, shared=0, plan_block=1)
E16_MAILBOX = dataclasses.replace(E16, latent=2)  # the mailbox packs latent columns in pairs


def assert_weight_bits(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_weights_correctly_rounded_on_the_rounding_row(select):
    """SPEC section 4's division, correctly rounded, through ``mf.route`` on "interpret" and "xla"."""
    logits = jnp.asarray([ROUNDING_ROW], jnp.float32)
    bias = jnp.zeros((E16.experts,), jnp.float32)
    want = np.asarray([0.06298828125], jnp.bfloat16)
    xla_ids, xla_weights = jax.jit(lambda l, b: mf.route(l, b, E16, backend="xla"))(logits, bias)
    ids, weights = interpret(logits, bias, cfg=E16, config=rt.RouteConfig(1, 1, select))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(xla_ids))
    np.testing.assert_array_equal(np.asarray(ids)[0], np.arange(16))
    assert_weight_bits(xla_weights[0, :1], want)
    assert_weight_bits(weights, xla_weights)
    via_dispatch = jax.jit(lambda l, b: mf.route(l, b, E16, backend="interpret"))(logits, bias)
    assert_weight_bits(via_dispatch[1], xla_weights)


def test_weights_correctly_rounded_through_route_collect(select):
    """The same row collected from the mailbox and routed by ``route_collect``."""
    cfg = E16_MAILBOX
    box = mf.Mailbox.create(cfg, capacity=1)
    logits = jnp.asarray([ROUNDING_ROW], jnp.float32)
    latent = jnp.zeros((1, cfg.latent), jnp.bfloat16)
    buffer, control, status = reference_mailbox.publish(box.buffer, box.control, logits, latent, 0,
                                                        cfg)
    bias = jnp.zeros((cfg.experts,), jnp.float32)

    @jax.jit
    def collect_route(buffer, control, status):
        return rc.route_collect(buffer, control, status, bias, 1, cfg, interpret=True,
                                config=rt.RouteConfig(1, 1, select))

    ids, weights, got_logits, *_ = collect_route(buffer, control, status)
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(ids)[0], np.arange(16))
    assert_weight_bits(weights[0, :1], np.asarray([0.06298828125], jnp.bfloat16))
    assert_weight_bits(weights, reference_route(logits, bias, cfg)[1])


@pytest.mark.parametrize("name, rows, block_rows", [("e16", 1 << 16, 4096), ("k3", 1 << 13, 256)])
def test_weights_equal_the_reference_on_many_rows(name, rows, block_rows):
    """Interpret's weight bits equal the reference's on every row: 2^16 rows of 16 experts (where
    XLA's reciprocal and merged sum changed 7 weights) and 8192 K3 rows (1 weight)."""
    cfg = {"e16": E16, "k3": K3}[name]
    rng = np.random.default_rng(36)
    logits = jnp.asarray(rng.normal(0, 2, (rows, cfg.experts)).astype(np.float32))
    bias = jnp.asarray(rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32))
    ids, weights = interpret(logits, bias, cfg=cfg, config=rt.RouteConfig(block_rows, 4, "groups"))
    want_ids, want_weights = reference_route(logits, bias, cfg)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    assert_weight_bits(weights, want_weights)


@pytest.mark.parametrize("name", ["k3", "e1024_top32", "e100_top6_plain"])
def test_property_thousands_of_adversarial_rows(name, select):
    """A seeded loop: 2048 rows per config in blocks of 256, each block with its own bias."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(2024)
    for _ in range(8):
        logits, bias = adversarial_rows(rng, 256, cfg.experts)
        check(logits, bias, cfg, rt.RouteConfig(64, 4, select))


# --- the grouped selection ---------------------------------------------------------------------------

# (experts, top_k, RouteConfig.group, RouteConfig.width) -> the widths group_plan gives: every shape
# of select_grouped (level 1 only, one or two more levels, groups of one lane, one slot) or None.
PLANS = {
    (896, 16, 0, 0): (16, 4),
    (896, 16, 8, 0): (8, 4),
    (896, 16, 8, 8): (8,),
    (896, 16, 16, 8): (16, 8),
    (896, 16, 32, 0): (32, 8, 4),
    (896, 16, 64, 0): None,  # 14 groups hold experts, fewer than 16
    (896, 16, 128, 0): None,  # 8 groups, fewer than 16 slots
    (1024, 16, 64, 0): (64, 16, 4),
    (1024, 32, 0, 0): (8, 4),
    (1024, 32, 0, 2): (8, 2),
    (384, 8, 0, 0): (16, 4),
    (256, 8, 0, 0): (8, 4),
    (100, 6, 0, 0): (4,),
    (100, 6, 0, 8): (4,),
    (300, 7, 2, 0): (2,),
    (20, 16, 0, 0): (1,),
    (5, 3, 0, 0): (1,),
    (256, 1, 0, 0): (64, 16, 4),
}


def test_group_plan():
    for (experts, k, group, width), widths in PLANS.items():
        lanes = rt.next_power_of_2(experts)
        assert rt.group_plan(lanes, experts, k, group, width) == widths, (experts, k, group, width)


def ranked_lanes(keys, k):
    """numpy: per row the lanes of the k largest int keys, ties to the lower lane."""
    lanes = np.arange(keys.shape[1])
    return np.stack([np.lexsort((lanes, -row.astype(np.int64)))[:k] for row in keys])


@pytest.mark.parametrize("experts, k, group, width", [key for key, plan in PLANS.items() if plan])
def test_select_grouped_outside_a_kernel(experts, k, group, width):
    """select_grouped as plain JAX on ordered keys (keys_at a take_along_axis) against a numpy sort,
    on 512 rows of few distinct keys (ties across groups and at the cut), NaN and padding keys."""
    lanes, slots = rt.next_power_of_2(experts), rt.next_power_of_2(k)
    widths = rt.group_plan(lanes, experts, k, group, width)
    rng = np.random.default_rng(experts * 100 + k + group + width)
    rows = 512
    distinct = rng.integers(1, 40, (rows, 1))  # per row, how many distinct key values
    keys = (rng.integers(0, 1 << 20, (rows, lanes)) % distinct - 20).astype(np.int32)
    keys = np.where(rng.random((rows, lanes)) < 0.05, np.int32(rt.NAN_KEY), keys)
    keys[rows // 2:][rng.random(rows // 2) < 0.5] = rt.NAN_KEY  # all-NaN rows
    keys[:, experts:] = rt.PAD_KEY

    @jax.jit
    def select(ordered):
        def keys_at(at):
            flat = jnp.take_along_axis(ordered, at.reshape(at.shape[0], -1), axis=1)
            return flat.reshape(at.shape)

        lane = jnp.arange(lanes, dtype=jnp.int32)[None]
        slot = jnp.arange(slots, dtype=jnp.int32)[None]
        return rt.select_grouped(ordered, lane, slot, k, keys_at, widths)

    ids = np.asarray(select(jnp.asarray(keys)))
    assert ids.shape == (rows, slots)
    np.testing.assert_array_equal(ids[:, :k], ranked_lanes(keys, k))
    assert (ids[:, k:] == 0).all()


@pytest.mark.parametrize(
    "experts, k, group, width",
    [(1024, 16, 64, 0), (896, 16, 32, 0), (896, 16, 8, 8), (20, 16, 0, 0), (300, 7, 2, 0)],
)
def test_grouped_plans_in_the_kernel(experts, k, group, width):
    """The kernel's groups selection with the other plans (three levels, one, groups of one lane)
    on adversarial rows in blocks of 4 rows, a ragged last one."""
    cfg = mf.FrontConfig(hidden=256, experts=experts, top_k=k, latent=128, shared=0)
    logits, bias = adversarial_rows(np.random.default_rng(experts + k), 37, experts)
    check(logits, bias, cfg, rt.RouteConfig(4, 4, "groups", group, width))


# --- registration, lowering, errors ------------------------------------------------------------------


def test_registered_behind_route_and_moe_front():
    stage = registry.STAGES["route"]
    assert stage.kernel == "moe_front_jax.pallas.route.stage:route" and stage.auto == registry.ALWAYS
    logits = jnp.zeros((5, K3.experts), jnp.float32)
    bias = jnp.zeros((K3.experts,), jnp.float32)
    assert registry.choose("route", "interpret", logits, bias, K3).kernel
    assert not registry.choose("route", "xla", logits, bias, K3).kernel
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(0, 2, (5, K3.experts)).astype(np.float32))
    bias = jnp.asarray(rng.uniform(-0.05, 0.05, K3.experts).astype(np.float32))
    got = jax.jit(lambda l, b: mf.route(l, b, K3, backend="interpret"))(logits, bias)
    want = reference_route(logits, bias, K3)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(
        np.asarray(got[1]).view(np.uint16), np.asarray(want[1]).view(np.uint16)
    )


@pytest.mark.parametrize(
    "name, batches", [("k3", (1, 64, 256)), ("e1024_top32", (1, 37)), ("e100_top6_plain", (3,))]
)
def test_lowers_for_h200_as_one_kernel(name, batches, select):
    """One Triton kernel per call; no sort, top_k, gather or division left to XLA. The picked
    schedules (with ``select`` in place of theirs), and blocks of 4 rows."""
    cfg = CONFIGS[name]
    bias = jnp.zeros((cfg.experts,), jnp.float32)

    def route(logits, bias, block_rows=None):
        config = rt.pick_config(logits.shape[0], cfg.experts, cfg.top_k)  # the H200's, when tracing
        if block_rows is not None:
            config = dataclasses.replace(config, block_rows=block_rows)
        return rt.route(logits, bias, cfg, config=dataclasses.replace(config, select=select))

    for batch, block_rows in [(batch, None) for batch in batches] + [(max(batches), 4)]:
        logits = jnp.zeros((batch, cfg.experts), jnp.float32)
        text = lower_for_h200(functools.partial(route, block_rows=block_rows), logits, bias)
        assert text.count("__gpu$xla.gpu.triton") == 1
        for op in ("stablehlo.sort", "top_k", "stablehlo.gather", "stablehlo.divide", "logistic"):
            assert op not in text, (name, batch, op)


@pytest.mark.parametrize("kind", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"])
def test_schedule_table_from_tuning_data(kind):
    """``pallas/tuning/nvidia-h200/route.json``: 8 warps up to B=64, 4 up to 256, the groups
    selection; the H100 borrows it (``device.TABLES_OF``); past 256 rows, other shapes and other
    devices take the heuristic."""
    narrow, wide = rt.RouteConfig(1, 8, "groups"), rt.RouteConfig(1, 4, "groups")
    assert rt.load_table("NVIDIA H200") == {rt.table_key(896, 16): ((64, narrow), (256, wide))}
    heuristic = rt.heuristic_config(1, 896, 16)
    tabled = kind != "NVIDIA A100-SXM4-80GB"
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        for batch, want in [(1, narrow), (64, narrow), (65, wide), (256, wide)]:
            assert rt.pick_config(batch, 896, 16) == (want if tabled else heuristic), batch
        assert rt.pick_config(257, 896, 16) == rt.heuristic_config(257, 896, 16)
        assert rt.pick_config(1, 256, 8) == rt.heuristic_config(1, 256, 8)


def test_heuristic_and_config_errors():
    assert rt.heuristic_config(1, 896, 16) == rt.RouteConfig(1, 4, "groups")
    assert rt.heuristic_config(1, 100, 6) == rt.RouteConfig(1, 1, "groups")
    with pytest.raises(ValueError, match="RouteConfig.block_rows must be a power of two"):
        rt.RouteConfig(3, 4)
    with pytest.raises(ValueError, match="RouteConfig.num_warps must be a power of two"):
        rt.RouteConfig(1, 0)
    with pytest.raises(ValueError, match="RouteConfig.select must be one of .* got 'radix'"):
        rt.RouteConfig(1, 4, "radix")
    with pytest.raises(ValueError, match="RouteConfig.group must be 0 or a power of two, got 12"):
        rt.RouteConfig(1, 4, "groups", 12)
    with pytest.raises(ValueError, match="RouteConfig.width must be 0 or a power of two, got -4"):
        rt.RouteConfig(1, 4, "groups", 8, -4)
    configs = [rt.RouteConfig(1, 4), rt.RouteConfig(2, 8, "groups"),
               rt.RouteConfig(1, 4, "groups", 8), rt.RouteConfig(1, 4, "groups", 8, 8)]
    assert [c.name for c in configs] == ["r1w4", "r2w8g", "r1w4g8", "r1w4g8x8"]
    assert_argument_errors(rt.route)
    bias = jnp.zeros((K3.experts,), jnp.float32)
    with pytest.raises(ValueError, match="config must be a RouteConfig"):
        rt.route(jnp.zeros((2, 896), jnp.float32), bias, K3, config=(1, 4))
    big = mf.FrontConfig(hidden=64, experts=8192, top_k=16, latent=32, shared=0)
    with pytest.raises(NotImplementedError, match="up to 4096 experts"):
        rt.route(jnp.zeros((1, 8192), jnp.float32), jnp.zeros((8192,), jnp.float32), big)


# --- on the GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_matches_xla_reference(select):
    """``compare_with_xla_on_gpu`` with both selections, each with the device's picked schedules."""
    cfg = K3

    def route(logits, bias):
        config = rt.pick_config(logits.shape[0], cfg.experts, cfg.top_k)
        return rt.route(logits, bias, cfg, config=dataclasses.replace(config, select=select))

    assert_edge_ids(compare_with_xla_on_gpu(jax.jit(route), cfg))
