"""moe_front and route end to end under jax.jit, the config, and every bad-input error (SPEC 8)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference, registry
from bitwise import plan_bytes
import oracle

SMALL = mf.FrontConfig(hidden=256, experts=128, top_k=16, latent=128, shared=64)


@functools.cache
def small_params(cfg=SMALL, shared=True):
    return mf.pack_params(mf.init_weights(jax.random.key(0), cfg, shared=shared), cfg)


def rows(batch, hidden=256, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, hidden)).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("plan", "backend"))
def front(x, params, plan=False, backend="xla"):
    return mf.moe_front(x, params, plan=plan, backend=backend)


@pytest.mark.parametrize("batch", [1, 3, 37, 255])
def test_moe_front_matches_oracles(batch):
    params, x = small_params(), rows(batch)
    out = front(x, params, plan=True)
    w = mf.init_weights(jax.random.key(0), SMALL)
    x64 = np.asarray(x, np.float64)
    logits64 = x64 @ np.asarray(w[mf.params.GATE], np.float64).T
    bound = np.abs(x64) @ np.abs(np.asarray(w[mf.params.GATE], np.float64)).T
    assert out.logits.shape == (batch, 128) and out.logits.dtype == jnp.float32
    assert (np.abs(np.asarray(out.logits) - logits64) <= 1e-5 * bound).all()
    latent64 = x64 @ np.asarray(w[mf.params.ROUTED_DOWN], np.float64).T
    assert oracle.bf16_ulp_distance(out.latent, latent64.astype(ml_dtypes.bfloat16)).max() <= 1
    # Routing and plan are exact functions of the logits and latent the call returned.
    ids, weights = oracle.route(np.asarray(out.logits), np.asarray(w[mf.params.BIAS]), 16)
    np.testing.assert_array_equal(np.asarray(out.ids), ids)
    assert oracle.bf16_ulp_distance(out.weights, weights).max() <= 1
    values, scales = oracle.mxfp8_plan(np.asarray(out.latent))
    got_values, got_scales = plan_bytes(out.plan)
    np.testing.assert_array_equal(got_scales, scales)
    np.testing.assert_array_equal(got_values, values.view(np.uint8))
    shared = oracle.shared_expert(x, w[mf.params.GATE_UP], w[mf.params.DOWN])
    got = np.asarray(out.shared, np.float64)
    assert out.shared.dtype == jnp.bfloat16
    assert np.linalg.norm(got - shared) / np.linalg.norm(shared) < 1e-2
    assert int(out.status) == 0


def non_finite_case():
    """Rows and weights with NaN and infinities (SPEC section 8): row 0 all NaN, row 1 all +inf,
    row 2 +inf and -inf halves, row 3 finite; a NaN router row (expert 5) and an infinite latent
    row; the result of every product is then NaN, inf or finite by row."""
    x = np.asarray(rows(4), np.float32)
    x[0], x[1], x[2, :128], x[2, 128:] = np.nan, np.inf, np.inf, -np.inf
    w = dict(mf.init_weights(jax.random.key(0), SMALL))
    gate = np.asarray(w[mf.params.GATE], np.float32)
    gate[5] = np.nan
    down = np.asarray(w[mf.params.ROUTED_DOWN], np.float32)
    down[3] = np.inf
    w[mf.params.GATE] = jnp.asarray(gate, jnp.bfloat16)
    w[mf.params.ROUTED_DOWN] = jnp.asarray(down, jnp.bfloat16)
    return jnp.asarray(x, jnp.bfloat16), mf.pack_params(w, SMALL)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_non_finite_rows_and_weights_give_distinct_ids(backend):
    x, params = non_finite_case()
    out = front(x, params, plan=True, backend=backend)
    oracle.assert_valid_ids(out.ids, SMALL.experts)
    assert int(out.status) == 0
    box = mf.Mailbox.create(SMALL, capacity=4)
    through, _ = jax.jit(functools.partial(mf.moe_front, backend=backend, plan=True))(
        x, params, mailbox=box)
    oracle.assert_valid_ids(through.ids, SMALL.experts)
    assert int(through.status) == 0
    np.testing.assert_array_equal(through.ids, out.ids)
    # The finite row is routed as ever; the all-NaN row takes the lowest ids (NaN keys, ties low).
    np.testing.assert_array_equal(out.ids[3], front(x[3:], params, backend=backend).ids[0])
    np.testing.assert_array_equal(out.ids[0], np.arange(SMALL.top_k))
    # Expert 5's router row is NaN, so its logit is NaN in every row and it ranks below the rest.
    assert np.isnan(np.asarray(out.logits)[:, 5]).all()
    assert 5 not in np.asarray(out.ids[3])
    # Routing and plan are exact functions of the non-finite logits and latent the call returned
    # (SPEC sections 4 and 5): NaN experts weigh 0, so no weight is NaN.
    ids, weights = oracle.route(np.asarray(out.logits), np.asarray(params.bias), SMALL.top_k)
    np.testing.assert_array_equal(np.asarray(out.ids), ids)
    assert not np.isnan(np.asarray(out.weights, np.float32)).any()
    assert oracle.bf16_ulp_distance(out.weights, weights).max() <= 1
    values, scales = oracle.mxfp8_plan(np.asarray(out.latent))
    np.testing.assert_array_equal(plan_bytes(out.plan)[1], scales)
    got = np.asarray(out.plan[0]).astype(np.float32)
    np.testing.assert_array_equal(got, values.astype(np.float32))  # NaN where NaN, of either sign


def test_optional_outputs_are_none():
    out = front(rows(2), small_params(shared=False))
    assert out.shared is None and out.plan is None


@pytest.mark.parametrize(
    "cfg",
    [
        mf.FrontConfig(hidden=128, experts=256, top_k=8, latent=64, shared=0),
        mf.FrontConfig(hidden=128, experts=384, top_k=8, latent=64, shared=32),
    ],
    ids=["e256_top8", "e384_top8"],
)
def test_other_configs(cfg):
    params = mf.pack_params(mf.init_weights(jax.random.key(3), cfg), cfg)
    out = front(rows(5, 128), params)
    assert out.ids.shape == (5, 8) and out.weights.shape == (5, 8)
    ids, _ = oracle.route(np.asarray(out.logits), np.asarray(params.bias), 8)
    np.testing.assert_array_equal(np.asarray(out.ids), ids)
    assert (out.shared is None) == (cfg.shared == 0)


def test_kimi_k3_defaults():
    cfg = mf.KIMI_K3
    assert (cfg.hidden, cfg.experts, cfg.top_k, cfg.latent, cfg.shared) == (7168, 896, 16, 3584, 6144)
    assert cfg.mailbox_width == 5376
    assert [cfg.with_tp(t).experts_per_rank for t in (1, 2, 4, 8, 16)] == [896, 448, 224, 112, 56]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden", 0, "FrontConfig.hidden must be a positive int, got 0"),
        ("experts", -4, "FrontConfig.experts must be a positive int"),
        ("top_k", 1000, "FrontConfig.top_k=1000 must be <= FrontConfig.experts=896"),
        ("tp", 3, "FrontConfig.experts=896 must be divisible by tp=3"),
        ("tp", 5, "FrontConfig.experts=896 must be divisible by tp=5"),
        ("shared", 6008, "FrontConfig.shared=6008 must be divisible by tp=16"),
        ("latent", 3592, "FrontConfig.latent=3592 must be divisible by tp=16"),
        ("latent", 3600, "FrontConfig.latent=3600 must be divisible by plan_block=32"),
        ("routed_scaling_factor", float("nan"), "routed_scaling_factor must be a finite number"),
        ("top_k", 16.0, "FrontConfig.top_k must be a positive int, got 16.0"),
        ("top_k", True, "FrontConfig.top_k must be a positive int, got True"),
        ("renormalize", "no", "FrontConfig.renormalize must be a bool, got 'no'"),
    ],
)
def test_config_errors(field, value, message):
    extra = {"tp": 16} if field == "shared" or value == 3592 else {}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        dataclasses.replace(mf.KIMI_K3, **{field: value}, **extra)


@pytest.mark.parametrize(
    "x, message",
    [
        (jnp.zeros((0, 256), jnp.bfloat16), r"x is an empty batch \(shape \(0, 256\)\)"),
        (jnp.zeros((4, 255), jnp.bfloat16), r"x must have shape \[B, hidden=256\], got \(4, 255\)"),
        (jnp.zeros((256,), jnp.bfloat16), r"x must have shape \[B, hidden=256\], got \(256,\)"),
        (jnp.zeros((4, 256), jnp.float32), "x must be bfloat16, got float32"),
    ],
)
def test_bad_rows_raise_at_trace_time(x, message):
    with pytest.raises(ValueError, match=message):
        jax.jit(mf.moe_front).trace(x, small_params())


def test_numpy_scalars_are_taken_as_python_numbers():
    cfg = dataclasses.replace(mf.KIMI_K3, hidden=np.int64(7168), routed_scaling_factor=np.float32(2.5),
                              renormalize=np.bool_(False))
    assert type(cfg.hidden) is int and type(cfg.renormalize) is bool
    assert type(cfg.routed_scaling_factor) is float
    plain = dataclasses.replace(mf.KIMI_K3, routed_scaling_factor=2.5, renormalize=False)
    assert cfg == plain and hash(cfg) == hash(plain)  # one static argument to jit
    inexact = dataclasses.replace(mf.KIMI_K3, routed_scaling_factor=np.float32(0.1))
    assert inexact.routed_scaling_factor == float(np.float32(0.1))
    assert type(inexact.routed_scaling_factor) is float
    w = mf.init_weights(jax.random.key(0), SMALL)
    np.testing.assert_array_equal(mf.pack_params(w, SMALL.with_tp(2), rank=np.int64(1)).packed,
                                  mf.pack_params(w, SMALL.with_tp(2), rank=1).packed)


def test_non_arrays_are_named():
    with pytest.raises(ValueError, match=r"x must be a \[B, hidden=256\] bfloat16 array, got a list"):
        mf.moe_front([[0.0] * 256], small_params())
    with pytest.raises(ValueError, match=r"bias must be \(128,\) float32, got a list"):
        mf.route(jnp.zeros((2, 128), jnp.float32), [0.0] * 128, SMALL)


def test_a_traced_plan_says_to_make_it_static():
    with pytest.raises(ValueError, match=r"plan is traced: .*static_argnames=\('plan',\)"):
        jax.jit(mf.moe_front)(rows(1), small_params(), plan=True)
    with pytest.raises(ValueError, match="plan must be a bool, got int 1"):
        mf.moe_front(rows(1), small_params(), plan=1)
    out = jax.jit(mf.moe_front, static_argnames="plan")(rows(1), small_params(), plan=True)
    assert out.plan[0].shape == (1, SMALL.latent)


def test_bad_params():
    params = small_params()
    with pytest.raises(ValueError, match=r"params must be FrontParams \(from pack_params or "
                       r"shard_params\), got dict"):
        mf.moe_front(rows(1), {"packed": params.packed})
    wrong = dataclasses.replace(params, bias=params.bias.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"params.bias is \(128,\) bfloat16, expected \(128,\) float32"):
        mf.moe_front(rows(1), wrong)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'xla', 'pallas', "
                       r"'interpret'\), got 'cuda'"):
        mf.moe_front(rows(1), params, backend="cuda")
    for given, missing in (("gate_up", "down"), ("down", "gate_up")):
        half = dataclasses.replace(params, **{missing: None})
        with pytest.raises(ValueError, match=f"params.{given} is given but params.{missing} is None"):
            mf.moe_front(rows(1), half)
    sharded = mf.pack_params(mf.init_weights(jax.random.key(0), SMALL), SMALL.with_tp(2), rank=1)
    with pytest.raises(ValueError, match="one rank's shard of tp=2"):
        mf.moe_front(rows(1), sharded)


def test_bad_weights():
    w = dict(mf.init_weights(jax.random.key(0), SMALL))
    with pytest.raises(ValueError, match="rank must be an int in \\[0, tp=1\\), got 1"):
        mf.pack_params(w, SMALL, rank=1)
    for align in (2.5, True, 0):
        with pytest.raises(ValueError, match=f"split_align must be a positive int, got {align!r}"):
            mf.pack_params(w, SMALL, split_align=align)
    w[mf.params.GATE] = w[mf.params.GATE][:-1]
    with pytest.raises(ValueError, match=r"weights\['gate.weight'\] is \(127, 256\) bfloat16, expected \(128, 256\)"):
        mf.pack_params(w, SMALL)
    w = dict(mf.init_weights(jax.random.key(0), SMALL))
    w[mf.params.GATE] = w[mf.params.GATE].astype(jnp.float32)
    with pytest.raises(ValueError, match=r"weights\['gate.weight'\] is \(128, 256\) float32, "
                       r"expected \(128, 256\) bfloat16"):
        mf.pack_params(w, SMALL)
    w = dict(mf.init_weights(jax.random.key(0), SMALL))
    del w[mf.params.ROUTED_DOWN]
    with pytest.raises(ValueError, match="weights is missing key 'routed_down_weight'"):
        mf.pack_params(w, SMALL)
    w = dict(mf.init_weights(jax.random.key(0), SMALL))
    del w[mf.params.DOWN]
    with pytest.raises(ValueError, match="has 'shared_experts.gate_up_proj.weight' but not"):
        mf.pack_params(w, SMALL)
    # A key the config has no place for: named, not dropped.
    w = dict(mf.init_weights(jax.random.key(0), SMALL))
    with pytest.raises(ValueError, match="'gate.e_score_correction_bias' is given but "
                       "FrontConfig.bias is False"):
        mf.pack_params(w, dataclasses.replace(SMALL, bias=False))
    del w[mf.params.BIAS]
    with pytest.raises(ValueError, match="'routed_down_weight' is given but FrontConfig.latent is 0"):
        mf.pack_params(w, dataclasses.replace(SMALL, bias=False, latent=0))


def test_route_errors():
    bias = jnp.zeros((128,), jnp.float32)
    with pytest.raises(ValueError, match=r"logits must have shape \[B, experts=128\], got \(2, 64\)"):
        mf.route(jnp.zeros((2, 64), jnp.float32), bias, SMALL)
    with pytest.raises(ValueError, match="logits must be float32, got bfloat16"):
        mf.route(jnp.zeros((2, 128), jnp.bfloat16), bias, SMALL)
    with pytest.raises(ValueError, match="logits is an empty batch"):
        mf.route(jnp.zeros((0, 128), jnp.float32), bias, SMALL)
    with pytest.raises(ValueError, match=r"bias must be \(128,\) float32, got \(64,\) float32"):
        mf.route(jnp.zeros((2, 128), jnp.float32), bias[:64], SMALL)


def test_a_config_passes_through_jit_as_a_static_pytree_node():
    """``FrontConfig`` is a pytree node with no leaves: ``jax.jit(mf.route)`` takes it positionally
    without ``static_argnames``, and another config traces anew (it is part of the cache key)."""
    assert jax.tree.leaves(SMALL) == []
    assert jax.tree.unflatten(jax.tree.structure(SMALL), []) == SMALL
    logits = jax.random.normal(jax.random.key(4), (3, SMALL.experts), jnp.float32)
    bias = small_params().bias
    routed = jax.jit(mf.route)
    ids, weights = routed(logits, bias, SMALL)
    want_ids, want_weights = mf.route(logits, bias, SMALL, backend="xla")
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(weights, want_weights)
    top4 = dataclasses.replace(SMALL, top_k=4)
    assert routed(logits, bias, top4)[0].shape == (3, 4)
    assert hash(top4) != hash(SMALL) and top4 != SMALL
    with pytest.raises(dataclasses.FrozenInstanceError):
        top4.top_k = 8


@pytest.mark.parametrize("key", [0, np.zeros(2, np.int32), "seed", jnp.zeros(3, jnp.uint32)])
def test_init_weights_refuses_a_key_that_is_not_a_prng_key(key):
    with pytest.raises(ValueError, match=r"key must be a jax.random key \(jax.random.key\(seed\)"):
        mf.init_weights(key, SMALL)
    legacy = mf.init_weights(jax.random.PRNGKey(0), SMALL)
    assert legacy[mf.params.GATE].shape == (SMALL.experts, SMALL.hidden)


def abstract(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def gemm_args(batch, cfg=SMALL):
    """``front_gemm``'s arguments for ``batch`` rows as shapes only (``x, packed, split, valid``)."""
    params = small_params(cfg)
    packed = abstract(params.packed.shape, jnp.bfloat16)
    return abstract((batch, cfg.hidden), jnp.bfloat16), packed, params.split, cfg.experts


def test_an_unknown_stage_is_a_value_error():
    with pytest.raises(ValueError, match="unknown stage 'topk'"):
        registry.choose("topk", "xla")
    with pytest.raises(ValueError, match="unknown stage 'topk'"):
        registry.run("topk", "auto")


@pytest.mark.parametrize("on_gpu", [False, True])
def test_xla_always_runs_the_reference(monkeypatch, on_gpu):
    monkeypatch.setattr(registry, "on_gpu", lambda: on_gpu)
    for name in registry.STAGES:
        assert not registry.choose(name, "xla").kernel, name
    logits, bias = abstract((2, 128), jnp.float32), abstract((128,), jnp.float32)
    assert not registry.choose("route", "xla", logits, bias, SMALL).kernel
    assert not registry.choose("front_gemm", "xla", *gemm_args(2)).kernel


def test_interpret_runs_the_kernels_but_the_mailbox_reference():
    logits, bias = abstract((2, 128), jnp.float32), abstract((128,), jnp.float32)
    assert registry.choose("route", "interpret", logits, bias, SMALL).kernel
    assert registry.choose("front_gemm", "interpret", *gemm_args(2)).kernel
    assert registry.choose("plan", "interpret", abstract((2, 128), jnp.bfloat16), 32).kernel
    # The mailbox's jax-triton publish and collect have no interpret mode: the reference runs.
    for name in ("mailbox_publish", "mailbox_collect"):
        assert not registry.STAGES[name].interprets
        assert not registry.choose(name, "interpret").kernel
    assert all(stage.interprets for name, stage in registry.STAGES.items()
               if name not in ("mailbox_publish", "mailbox_collect"))


def test_auto_falls_through_where_a_kernel_does_not_cover(monkeypatch):
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    # B = 300 rows: more than the front GEMM's and the shared expert's kernels cover.
    assert not registry.choose("front_gemm", "auto", *gemm_args(300)).kernel
    with pytest.raises(NotImplementedError, match="B <= 256 rows per call, got B=300"):
        registry.choose("front_gemm", "interpret", *gemm_args(300))
    params = small_params()
    shared = (abstract((300, SMALL.hidden), jnp.bfloat16), abstract(params.gate_up.shape, jnp.bfloat16),
              abstract(params.down.shape, jnp.bfloat16), SMALL)
    assert not registry.choose("shared_expert", "auto", *shared).kernel
    with pytest.raises(NotImplementedError):
        registry.choose("shared_expert", "interpret", *shared)
    # The routing kernel covers any B, but no more than its lanes' experts.
    wide = mf.FrontConfig(hidden=256, experts=8192, top_k=8, latent=128, shared=0)
    logits, bias = abstract((300, 8192), jnp.float32), abstract((8192,), jnp.float32)
    assert not registry.choose("route", "auto", logits, bias, wide).kernel
    with pytest.raises(NotImplementedError, match="up to 4096 experts"):
        registry.choose("route", "interpret", logits, bias, wide)
    # A covered request runs the kernel (routing: "auto" always prefers it on a GPU).
    logits, bias = abstract((300, 128), jnp.float32), abstract((128,), jnp.float32)
    assert registry.choose("route", "auto", logits, bias, SMALL).kernel


@pytest.mark.parametrize("call", ["moe_front", "route"])
def test_pallas_without_a_gpu_suggests_interpret(call):
    assert not registry.on_gpu()
    message = r"backend='pallas' .*use backend='interpret'"
    with pytest.raises(ValueError, match=message):
        if call == "moe_front":
            mf.moe_front(rows(1), small_params(), backend="pallas")
        else:
            mf.route(jnp.zeros((2, 128), jnp.float32), jnp.zeros((128,), jnp.float32), SMALL,
                     backend="pallas")


MID = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=128, shared=64)


def test_more_rows_than_a_kernel_covers():
    params = small_params(MID)
    x = rows(257)
    auto = front(x, params, plan=True, backend="auto")
    xla = front(x, params, plan=True, backend="xla")
    for got, want in zip(jax.tree.leaves(auto), jax.tree.leaves(xla), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert auto.ids.shape == (257, 8)
    # One rule for every entry point and backend (SPEC section 9): a stage whose kernel does not
    # cover B runs its reference, and the plan says so; routing's kernel covers any B.
    interpret = front(x, params, plan=True, backend="interpret")
    for got, want in zip(jax.tree.leaves(interpret), jax.tree.leaves(xla), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    steps = {step.stage: step for step in mf.explain(x, params, plan=True,
                                                     backend="interpret").steps}
    assert not steps["front_gemm"].kernel
    assert "B <= 256 rows per call, got B=257" in steps["shared_expert"].why
    assert steps["route"].kernel and steps["plan"].kernel


NO_LATENT = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=0, shared=64)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_a_front_without_a_latent_returns_none_and_refuses_the_plan(backend):
    params = mf.pack_params(mf.init_weights(jax.random.key(0), NO_LATENT), NO_LATENT)
    x = rows(3, NO_LATENT.hidden)
    out = front(x, params, backend=backend)
    assert out.latent is None and out.plan is None and out.ids.shape == (3, 8)
    want = reference.route(reference.front_gemm(x, params.packed, params.split, 64)[0],
                           params.bias, NO_LATENT)
    for got, expected in zip((out.ids, out.weights), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    for call in (lambda: front(x, params, plan=True, backend=backend),
                 lambda: mf.explain(x, params, plan=True, backend=backend)):
        with pytest.raises(ValueError, match="FrontConfig.latent is 0: a front without a latent "
                                             "has no plan"):
            call()
