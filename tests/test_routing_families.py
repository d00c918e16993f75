"""Grouped routing (SPEC section 4.2) and softmax routing (4.3) in the reference, against the numpy
oracles of tests/oracle.py and hand-derived values: random rows, ties, NaN, all-NaN rows, +-inf; the
property that grouped routing never leaves the kept groups; the config rules that reject a bad
combination; and the presets."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import moe_front_jax as mf
import oracle
from moe_front_jax import registry

GROUPED = mf.FrontConfig(hidden=64, experts=64, top_k=8, latent=0, shared=0, groups=8, topk_groups=4,
                         routed_scaling_factor=2.5)
SOFTMAX = mf.FrontConfig(hidden=64, experts=32, top_k=4, latent=0, shared=0, scoring="softmax",
                         bias=False)
MIXTRAL_LIKE = dataclasses.replace(SOFTMAX, experts=8, top_k=2)


@functools.partial(jax.jit, static_argnums=2)
def jit_route(logits, bias, cfg):
    return mf.route(logits, bias, cfg, backend="xla")


def run(logits, bias, cfg):
    ids, weights = jit_route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    return np.asarray(ids), np.asarray(weights)


def want(logits, bias, cfg):
    if cfg.scoring == "softmax":
        return oracle.route_softmax(logits, cfg.top_k, cfg.routed_scaling_factor, cfg.renormalize)
    return oracle.route_grouped(logits, bias, cfg.top_k, cfg.groups, cfg.topk_groups,
                                cfg.routed_scaling_factor, cfg.renormalize)


def check(logits, bias, cfg):
    logits = np.asarray(logits, np.float32)
    bias = np.asarray(bias, np.float32)
    ids, weights = run(logits, bias, cfg)
    want_ids, want_weights = want(logits, bias, cfg)
    oracle.assert_valid_ids(ids, cfg.experts)
    np.testing.assert_array_equal(ids, want_ids)
    assert oracle.bf16_ulp_distance(weights, want_weights).max() <= 1
    return ids, weights


def groups_of(ids, cfg):
    return np.asarray(ids) // cfg.experts_per_group


@pytest.mark.parametrize("batch", [1, 3, 37])
@pytest.mark.parametrize("cfg", [GROUPED, dataclasses.replace(GROUPED, topk_groups=1),
                                 dataclasses.replace(GROUPED, experts=256, renormalize=False),
                                 SOFTMAX, MIXTRAL_LIKE, dataclasses.replace(SOFTMAX, renormalize=False)],
                         ids=["g8k4", "g8k1", "e256_norenorm", "softmax", "mixtral", "softmax_norenorm"])
def test_random_rows_match_the_oracle(cfg, batch):
    rng = np.random.default_rng(batch)
    logits = rng.standard_normal((batch, cfg.experts)).astype(np.float32)
    bias = rng.uniform(-0.05, 0.05, cfg.experts) if cfg.bias else np.zeros(cfg.experts)
    check(logits, bias, cfg)


def test_deepseek_v3_preset_random_rows_match_the_oracle():
    cfg = mf.configs.DEEPSEEK_V3
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, cfg.experts)).astype(np.float32)
    ids, weights = check(logits, rng.uniform(-0.05, 0.05, cfg.experts), cfg)
    assert all(len(set(row)) <= cfg.topk_groups for row in groups_of(ids, cfg))
    # Renormalized, then scaled by 2.5: each row's weights sum to 2.5 within bf16 roundings.
    np.testing.assert_allclose(weights.astype(np.float32).sum(-1), 2.5, rtol=2.0**-7)


def test_all_equal_rows_take_the_lowest_groups_and_ids():
    # Every key equal: every group scores the same, the lower group ids win, then the lower experts.
    ids, _ = check(np.zeros((2, 64)), np.zeros(64), GROUPED)
    np.testing.assert_array_equal(ids, np.tile(np.arange(8), (2, 1)))
    ids, _ = check(np.zeros((2, 32)), np.zeros(32), SOFTMAX)
    np.testing.assert_array_equal(ids, np.tile(np.arange(4), (2, 1)))


def test_group_ties_go_to_the_lower_group_and_expert_ties_to_the_lower_id():
    cfg = dataclasses.replace(GROUPED, topk_groups=2, top_k=4)
    logits = np.full((1, 64), -4.0, np.float32)
    # Groups 5 and 6 hold the same two best keys, group 2 better ones in a different place: group 2
    # then group 5 are kept (5 beats 6 on the tie), and the equal keys in them tie to lower ids.
    logits[0, [16, 17]] = 3.0
    logits[0, [43, 46]] = 2.0
    logits[0, [52, 55]] = 2.0
    ids, _ = check(logits, np.zeros(64), cfg)
    np.testing.assert_array_equal(ids, [[16, 17, 43, 46]])


def test_the_group_score_is_the_sum_of_two_best_not_the_best():
    cfg = dataclasses.replace(GROUPED, topk_groups=1, top_k=2)
    logits = np.full((1, 64), -6.0, np.float32)
    logits[0, 3] = 6.0                    # group 0: one great key, then nothing
    logits[0, [40, 41]] = 1.5             # group 5: two good keys, a larger sum
    ids, _ = check(logits, np.zeros(64), cfg)
    np.testing.assert_array_equal(ids, [[40, 41]])


def test_a_masked_expert_never_beats_a_kept_one_even_with_a_lower_key():
    # Kept keys all below every masked key would still be chosen: masked experts are out, not -inf.
    cfg = dataclasses.replace(GROUPED, topk_groups=1, top_k=8)
    bias = np.full(64, 0.3, np.float32)   # keys of 0.8 outside group 0...
    bias[:8] = 0.5                        # ...group 0 wins on its two keys of 1.0 (2.0 against 1.6)...
    logits = np.zeros((1, 64), np.float32)
    logits[0, 2:8] = -np.inf              # ...and its six other keys are 0.5, below every masked one
    ids, _ = check(logits, bias, cfg)
    assert set(ids[0]) == set(range(8))


@pytest.mark.parametrize("cfg", [GROUPED, SOFTMAX], ids=["grouped", "softmax"])
def test_nan_ranks_lowest_and_weighs_zero(cfg):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, cfg.experts)).astype(np.float32)
    logits[0, ::2] = np.nan
    logits[1, : cfg.experts // 2] = np.nan
    logits[2, 5] = np.nan
    ids, weights = check(logits, np.zeros(cfg.experts), cfg)
    chosen = np.take_along_axis(logits, ids, axis=-1)
    assert not np.isnan(chosen).any()     # enough numbers in every row
    assert np.isfinite(weights.astype(np.float32)).all()


@pytest.mark.parametrize("cfg", [GROUPED, SOFTMAX], ids=["grouped", "softmax"])
def test_all_nan_rows_give_distinct_ids_and_zero_weights(cfg):
    ids, weights = check(np.full((3, cfg.experts), np.nan), np.zeros(cfg.experts), cfg)
    np.testing.assert_array_equal(ids, np.tile(np.arange(cfg.top_k), (3, 1)))
    assert (weights.astype(np.float32) == 0).all()


def test_a_group_with_one_number_scores_nan_and_goes_last():
    cfg = dataclasses.replace(GROUPED, topk_groups=7, top_k=8)
    logits = np.zeros((1, 64), np.float32)
    logits[0, 1:8] = np.nan               # group 0: one number, then NaN: its score is NaN
    ids, _ = check(logits, np.zeros(64), cfg)
    assert not (groups_of(ids, cfg) == 0).any()


def test_infinities():
    grouped_logits = np.zeros((2, 64), np.float32)
    grouped_logits[0, 60:] = np.inf       # sigmoid(inf) = 1: group 7 leads
    grouped_logits[1] = -np.inf           # every sigmoid 0: the bias decides
    bias = np.linspace(-0.05, 0.05, 64, dtype=np.float32)
    ids, weights = check(grouped_logits, bias, GROUPED)
    assert set(ids[0, :4]) == {60, 61, 62, 63}
    assert (weights[1].astype(np.float32) == 0).all()   # chosen sigmoids are all 0
    softmax_logits = np.zeros((3, 32), np.float32)
    softmax_logits[0, 7] = -np.inf        # weighs 0 if chosen; ranked last
    softmax_logits[1] = -np.inf           # no largest finite logit: NaN probabilities weigh 0
    softmax_logits[2, 9] = np.inf         # exp(inf - inf): NaN probabilities weigh 0
    ids, weights = check(softmax_logits, np.zeros(32), SOFTMAX)
    assert 7 not in ids[0] and ids[2, 0] == 9
    assert (weights[1:].astype(np.float32) == 0).all()


def test_softmax_weights_are_the_softmax_of_the_chosen_logits():
    # Mixtral's form: softmax over the chosen logits; Qwen3's: softmax over all, renormalized.
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((64, 8)).astype(np.float32) * 3
    ids, weights = run(logits, np.zeros(8), MIXTRAL_LIKE)
    chosen = np.take_along_axis(logits, ids, axis=-1).astype(np.float64)
    mixtral = np.exp(chosen - chosen.max(-1, keepdims=True))
    mixtral /= mixtral.sum(-1, keepdims=True)
    assert oracle.bf16_ulp_distance(weights, mixtral.astype(oracle.BF16)).max() <= 1


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_grouped_routing_never_leaves_the_kept_groups(data):
    groups = data.draw(st.sampled_from([2, 4, 8]))
    per_group = data.draw(st.integers(2, 6))
    topk_groups = data.draw(st.integers(1, groups))
    top_k = data.draw(st.integers(1, topk_groups * per_group))
    experts = groups * per_group
    cfg = mf.FrontConfig(hidden=16, experts=experts, top_k=top_k, latent=0, shared=0, groups=groups,
                         topk_groups=topk_groups)
    rows = data.draw(st.integers(1, 4))
    values = st.floats(width=32, allow_nan=True, allow_infinity=True)
    logits = data.draw(hnp.arrays(np.float32, (rows, experts), elements=values))
    bias = data.draw(hnp.arrays(np.float32, (experts,),
                                elements=st.floats(-1, 1, width=32, allow_nan=False)))
    ids, _ = run(logits, bias, cfg)
    oracle.assert_valid_ids(ids, experts)
    # The keys from XLA's own sigmoid, which the reference uses: an oracle sigmoid one ulp away
    # could move a near-tie between groups.
    keys = (np.asarray(jax.nn.sigmoid(jnp.asarray(logits))) + bias).astype(np.float32)
    for row_ids, kept in zip(ids, oracle.kept_groups(keys, groups, topk_groups)):
        assert set(row_ids // per_group) <= set(kept)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(experts=60, groups=8), "FrontConfig.experts=60 must be divisible by groups=8"),
        (dict(groups=4, topk_groups=5), "FrontConfig.topk_groups=5 must be <= groups=4"),
        (dict(groups=8, topk_groups=1, top_k=16), r"topk_groups \* experts / groups = 1 \* 64 / 8 = 8"),
        (dict(groups=64, topk_groups=8), "groups > 1 needs experts / groups >= 2"),
        (dict(scoring="softmax"), "scoring='softmax' with bias=True"),
        (dict(scoring="softmax", bias=False, groups=2), "scoring='softmax' with groups=2"),
        (dict(scoring="tanh"), "FrontConfig.scoring must be one of"),
        (dict(activation="gelu"), "FrontConfig.activation must be one of"),
        (dict(bias=1), "FrontConfig.bias must be a bool, got 1"),
        (dict(latent=-32), "FrontConfig.latent must be an int >= 0, got -32"),
        (dict(latent=96, tp=64), "FrontConfig.latent=96 must be divisible by tp=64"),
        (dict(groups=0), "FrontConfig.groups must be a positive int, got 0"),
    ],
)
def test_config_names_the_bad_combination(changes, message):
    base = mf.FrontConfig(hidden=64, experts=64, top_k=8, latent=0, shared=0)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **changes)


def test_presets_have_their_published_sizes():
    c = mf.configs
    table = {name: (cfg.hidden, cfg.experts, cfg.top_k, cfg.groups, cfg.topk_groups, cfg.shared,
                    cfg.routed_scaling_factor, cfg.scoring, cfg.latent)
             for name, cfg in c.PRESETS.items()}
    assert table == {
        "KIMI_K3": (7168, 896, 16, 1, 1, 6144, 1.0, "sigmoid", 3584),
        "DEEPSEEK_V3": (7168, 256, 8, 8, 4, 2048, 2.5, "sigmoid", 0),
        "KIMI_K2": (7168, 384, 8, 1, 1, 2048, 2.827, "sigmoid", 0),
        "GLM_4_5": (5120, 160, 8, 1, 1, 1536, 2.5, "sigmoid", 0),
        "QWEN3_30B_A3B": (2048, 128, 8, 1, 1, 0, 1.0, "softmax", 0),
        "MIXTRAL_8X7B": (4096, 8, 2, 1, 1, 0, 1.0, "softmax", 0),
    }
    assert c.KIMI_K3 is mf.KIMI_K3 and c.KIMI_K3 == mf.FrontConfig()
    assert [cfg.activation for cfg in c.PRESETS.values()] == ["situ"] + ["silu"] * 5
    assert [cfg.bias for cfg in c.PRESETS.values()] == [True] * 4 + [False] * 2


def test_kimi_k3_routing_bits_are_unchanged():
    """The sigmoid path with one group is the plain top-k of SPEC section 4 (tests/oracle.route)."""
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((9, 896)).astype(np.float32)
    logits[0, :40] = logits[0, 40]        # ties
    logits[1, ::3] = np.nan
    bias = rng.uniform(-0.05, 0.05, 896).astype(np.float32)
    ids, weights = run(logits, bias, mf.KIMI_K3)
    want_ids, want_weights = oracle.route(logits, bias, 16)
    np.testing.assert_array_equal(ids, want_ids)
    assert oracle.bf16_ulp_distance(weights, want_weights).max() <= 1


def test_kernels_refuse_what_they_do_not_compute():
    """The Triton routing kernels rank sigmoid + bias over all experts and the separate
    shared-expert kernels apply situ: for the rest their ``covers`` raise (the routing stage then
    takes the Mosaic kernel, ``test_route_stage.py``; where it refuses too, as for 32 experts, and
    for the shared expert, every backend runs the reference: SPEC section 9). The engine (merged
    front, layer kernel) applies either activation."""
    from moe_front_jax.pallas.engine import kernel as engine
    from moe_front_jax.pallas.route import kernel as route_kernel
    from moe_front_jax.pallas.route_collect import kernel as route_collect
    from moe_front_jax.pallas.shared_expert import kernel as shared_expert

    logits, bias = jnp.zeros((2, 64), jnp.float32), jnp.zeros((64,), jnp.float32)
    with pytest.raises(NotImplementedError, match="groups=8, topk_groups=4 runs the reference"):
        route_kernel.covers(logits, bias, GROUPED)
    with pytest.raises(NotImplementedError, match="scoring='softmax'"):
        route_collect.covers(None, None, None, bias[:32], 2, SOFTMAX)
    route_kernel.covers(logits, bias, dataclasses.replace(GROUPED, topk_groups=8))  # every group
    silu = mf.FrontConfig(hidden=64, experts=64, top_k=8, latent=64, shared=64, activation="silu")
    x = jnp.zeros((2, 64), jnp.bfloat16)
    gate_up, down = jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="activation='silu' runs the reference"):
        shared_expert.covers(x, gate_up, down, silu)
    engine.covers_front_gate_up(x, jnp.zeros((128, 64), jnp.bfloat16), 64, 64, gate_up, silu)
    with pytest.raises(NotImplementedError, match="neither routing kernel covers this"):
        registry.choose("route", "interpret", logits[:, :32], bias[:32], SOFTMAX)
    ids, _ = mf.route(logits[:, :32], bias[:32], SOFTMAX, backend="interpret")  # the reference
    oracle.assert_valid_ids(np.asarray(ids), 32)


def test_fronts_without_a_latent_run_on_every_backend():
    """The Triton front GEMM writes a latent: at latent=0 its covers refuse. The engine streams the
    router rows alone, so on "interpret" a DeepSeek-V3 front with its shared expert runs the merged
    front's kernels (SiLU gate included) and the Mosaic routing kernel (its groups) with its
    dispatch order: the same ids, weights and order as backend="xla", the logits within 1e-5 and
    the shared expert within SPEC section 6's 1e-2."""
    from moe_front_jax.pallas.front_gemm import kernel as front_gemm

    x, packed = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="packed has no latent rows"):
        front_gemm.covers(x, packed, 64, 64)
    cfg = dataclasses.replace(mf.configs.DEEPSEEK_V3, hidden=128)
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
    plan = mf.explain((3, 128), params, backend="interpret", permute=True)
    assert plan.stages() == ("front_gate_up", "route", "shared_down")
    assert plan.steps[1].kernel and "mosaic_route" in plan.steps[1].why
    rows = jax.random.normal(jax.random.key(1), (3, 128), jnp.bfloat16)
    got = mf.moe_front(rows, params, backend="interpret", permute=True)
    want = mf.moe_front(rows, params, backend="xla", permute=True)
    assert got.latent is None and want.latent is None
    for got_part, want_part in zip(got.dispatch, want.dispatch, strict=True):
        np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part))
    for name in ("ids", "weights"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=name)
    for name, tol in (("logits", 1e-5), ("shared", 1e-2)):
        ref = np.asarray(getattr(want, name), np.float64)
        mag = np.maximum(np.abs(ref), np.sqrt((ref**2).mean(axis=1, keepdims=True)))
        assert (np.abs(np.asarray(getattr(got, name), np.float64) - ref) <= tol * mag).all(), name