"""The MXFP8 plan, situ, the shared expert and the front GEMM references against numpy oracles."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference
import oracle


def plan_bits(latent, block=32):
    values, scales = jax.jit(reference.mxfp8_plan, static_argnums=1)(jnp.asarray(latent), block)
    assert values.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float8_e8m0fnu
    return np.asarray(values), np.asarray(scales).view(np.uint8)


def assert_values_equal(got, want):
    g, w = got.view(np.uint8), want.view(np.uint8)
    nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(nan_g, nan_w)
    np.testing.assert_array_equal(np.where(nan_g, 0, g), np.where(nan_w, 0, w))


def test_plan_random_magnitudes():
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 1, (37, 256)) * np.exp2(rng.integers(-40, 40, (37, 8))).repeat(32, 1)
    latent = rows.reshape(37, 256).astype(ml_dtypes.bfloat16)
    values, scales = plan_bits(latent)
    want_values, want_scales = oracle.mxfp8_plan(latent)
    np.testing.assert_array_equal(scales, want_scales)
    assert_values_equal(values, want_values)


def test_plan_hand_cases():
    block = np.zeros((6, 32), np.float32)
    block[1, 0] = 448.0  # amax / 448 = 1 exactly: scale 2**0, byte 127, no rounding up
    block[2, :2] = [450.0, -3.0]  # just above 448 * 2**0: the scale rounds up to 2**1
    block[3, 5] = -2.0**-133  # a bf16 subnormal: amax / 448 < 2**-127 -> byte 0, values 0
    block[4, :3] = [np.inf, 1.0, -1.0]  # saturates at byte 254
    block[5, :3] = [0.3, 0.7, -0.5]  # 0.7 / 448 rounds up to 2**-9: values v * 512
    values, scales = plan_bits(block.reshape(1, -1).astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(scales[0], [0, 127, 128, 0, 254, 118])
    v = values.astype(np.float32).reshape(6, 32)
    assert (v[0] == 0).all() and (v[3] == 0).all()  # zero block; a scale that decodes to 0
    assert v[1, 0] == 448.0
    assert v[2, 0] == 224.0 and v[2, 1] == -1.5  # 450 / 2 = 225 -> nearest e4m3 224
    assert v[4, 0] == 448.0 and v[4, 1] == 0.0  # inf clamps; 1 * 2**-127 underflows to 0
    # 0.3 and 0.7 are not bf16-exact; their bf16 values times 512 then round to e4m3.
    want = np.array([0.3, 0.7, -0.5], ml_dtypes.bfloat16).astype(np.float64) * 512
    np.testing.assert_array_equal(v[5, :3], want.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_plan_nan_block():
    block = np.ones((1, 64), np.float32)
    block[0, 3] = np.nan
    values, scales = plan_bits(block.astype(ml_dtypes.bfloat16))
    want_values, want_scales = oracle.mxfp8_plan(block.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(scales, want_scales)
    assert_values_equal(values, want_values)
    assert scales[0, 0] == 254 and scales[0, 1] == oracle.e8m0_byte(1 / 448)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the NaN patterns warn no more
def test_plan_every_bfloat16_pattern():
    """All 65536 bfloat16 patterns shuffled into blocks of one large call, where XLA's CPU reductions
    take their vectorized loops: a block holding a NaN still gets byte 254."""
    patterns = np.random.default_rng(1).permutation(1 << 16).astype(np.uint16)
    latent = patterns.view(ml_dtypes.bfloat16).reshape(64, 1024)
    values, scales = plan_bits(latent)
    want_values, want_scales = oracle.mxfp8_plan(latent)
    np.testing.assert_array_equal(scales, want_scales)
    assert_values_equal(values, want_values)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the NaN patterns warn no more
def test_scale_exponent_for_every_bfloat16():
    """The division-free E8M0 exponent over all 65536 bfloat16 bit patterns as amax equals the
    SPEC's, computed in float64 by the oracle (subnormal quotients included)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    amax = np.abs(bits.view(ml_dtypes.bfloat16).astype(np.float32))
    got = np.asarray(jax.jit(reference.plan_scale_exponent)(jnp.asarray(amax.view(np.int32))))
    with np.errstate(invalid="ignore"):  # the signalling NaN patterns raise the flag when cast
        wide = amax.astype(np.float64)
    spec = np.array([oracle.e8m0_byte(float(a) / 448.0) for a in wide])
    np.testing.assert_array_equal(got, spec)


def test_situ():
    rng = np.random.default_rng(1)
    gate = rng.normal(0, 6, 4096).astype(ml_dtypes.bfloat16)
    up = rng.normal(0, 40, 4096).astype(ml_dtypes.bfloat16)
    got = np.asarray(jax.jit(reference.situ, static_argnums=(2, 3))(gate, up, 4.0, 25.0))
    assert oracle.bf16_ulp_distance(got, oracle.situ(gate, up)).max() <= 1


@pytest.mark.parametrize("tp", [1, 4])
def test_shared_expert_per_rank_sums_to_whole(tp):
    cfg = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=128, shared=192, tp=tp)
    w = mf.init_weights(jax.random.key(2), cfg)
    x = jax.random.normal(jax.random.key(3), (5, 256)).astype(jnp.bfloat16)
    want = oracle.shared_expert(x, w[mf.params.GATE_UP], w[mf.params.DOWN])
    partial = jax.jit(reference.shared_expert, static_argnums=(3, 4))
    total = sum(
        np.asarray(partial(x, p.gate_up, p.down, cfg, jnp.float32), np.float64)
        for p in (mf.pack_params(w, cfg, rank=r) for r in range(tp))
    )
    assert np.linalg.norm(total - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_front_gemm_rank_layout(tp):
    cfg = mf.FrontConfig(hidden=512, experts=96, top_k=8, latent=256, shared=0, tp=tp)
    w = mf.init_weights(jax.random.key(4), cfg)
    x = jax.random.normal(jax.random.key(5), (7, 512)).astype(jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    full = x64 @ np.asarray(w[mf.params.GATE], np.float64).T
    latent = x64 @ np.asarray(w[mf.params.ROUTED_DOWN], np.float64).T
    bound = np.abs(x64) @ np.abs(np.asarray(w[mf.params.GATE], np.float64)).T
    latent_bound = np.abs(x64) @ np.abs(np.asarray(w[mf.params.ROUTED_DOWN], np.float64)).T
    for r in range(tp):
        p = mf.pack_params(w, cfg, rank=r)
        assert p.split % 16 == 0 and p.split >= cfg.experts_per_rank
        assert not np.asarray(p.packed[cfg.experts_per_rank:p.split], np.float32).any()
        logits, shard = jax.jit(reference.front_gemm, static_argnums=(2, 3))(
            x, p.packed, p.split, cfg.experts_per_rank
        )
        cols = slice(r * cfg.experts_per_rank, (r + 1) * cfg.experts_per_rank)
        assert (np.abs(np.asarray(logits) - full[:, cols]) <= 1e-5 * bound[:, cols]).all()
        lat = slice(r * cfg.latent_per_rank, (r + 1) * cfg.latent_per_rank)
        # The float32 sum's error (relative to sum |x w|, which cancellation can make far larger
        # than the value), then one bfloat16 rounding: within one ulp of the float64 value plus it.
        err = np.abs(np.asarray(shard, np.float64) - latent[:, lat])
        assert (err <= oracle.bf16_ulp(latent[:, lat]) + 1e-5 * latent_bound[:, lat]).all()


def test_plan_reference_names_a_bad_latent():
    with pytest.raises(ValueError, match="latent's width L=100 must be a multiple of block=32"):
        reference.mxfp8_plan(jnp.zeros((2, 100), jnp.bfloat16))
    bad_dtype = r"latent must be a \[B, L\] bfloat16 array, got \(2, 64\) float32"
    with pytest.raises(ValueError, match=bad_dtype):
        reference.mxfp8_plan(jnp.zeros((2, 64), jnp.float32))
