"""Checkpoints of the open families through mf.load_weights / mf.load_params: DeepSeek's split shared
gate and up keys (DeepSeek-V3, Kimi-K2, GLM-4.5), a router without a correction bias (Qwen3-MoE,
Mixtral, under Mixtral's ``block_sparse_moe.`` prefix), fronts without a latent; files written here
with numpy under Hugging Face's names."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import moe_front_jax as mf
from moe_front_jax import params as P

DEEPSEEK = mf.FrontConfig(hidden=64, experts=32, top_k=4, latent=0, shared=32, groups=4,
                          topk_groups=2, routed_scaling_factor=2.5, activation="silu")
MIXTRAL = mf.FrontConfig(hidden=64, experts=8, top_k=2, latent=0, shared=0, scoring="softmax",
                         bias=False, activation="silu")
PREFIX = "model.layers.3.mlp."


def bf16(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)


def deepseek_layer(seed=0):
    """A DeepSeek-V3 layer's front as its checkpoint names it, with a routed expert beside it."""
    rng = np.random.default_rng(seed)
    h, e, s = DEEPSEEK.hidden, DEEPSEEK.experts, DEEPSEEK.shared
    return {
        "gate.weight": bf16(rng, e, h),
        "gate.e_score_correction_bias": rng.uniform(-0.05, 0.05, e).astype(np.float32),
        "shared_experts.gate_proj.weight": bf16(rng, s, h),
        "shared_experts.up_proj.weight": bf16(rng, s, h),
        "shared_experts.down_proj.weight": bf16(rng, h, s),
        "experts.0.gate_proj.weight": bf16(rng, 16, h),
    }


def spec_weights(layer):
    """The SPEC's keys of a DeepSeek layer: gate and up stacked, gate rows first."""
    return {
        P.GATE: layer["gate.weight"],
        P.BIAS: layer["gate.e_score_correction_bias"],
        P.GATE_UP: np.concatenate([layer["shared_experts.gate_proj.weight"],
                                   layer["shared_experts.up_proj.weight"]]),
        P.DOWN: layer["shared_experts.down_proj.weight"],
    }


def assert_same(got, want):
    assert set(got) == set(want)
    for name, array in want.items():
        bits = np.uint16 if array.dtype.itemsize == 2 else np.uint32
        np.testing.assert_array_equal(np.asarray(got[name]).view(bits), array.view(bits), err_msg=name)


def test_deepseek_split_gate_and_up_load_as_the_fused_key(tmp_path):
    layer = deepseek_layer()
    save_file({PREFIX + k: v for k, v in layer.items()}, str(tmp_path / "model.safetensors"))
    weights = mf.load_weights(tmp_path, DEEPSEEK, prefix=PREFIX)
    assert_same(weights, spec_weights(layer))
    params = mf.load_params(tmp_path, DEEPSEEK, prefix=PREFIX)
    assert params.packed.shape == (DEEPSEEK.experts, DEEPSEEK.hidden)   # router rows alone
    x = jax.random.normal(jax.random.key(0), (4, DEEPSEEK.hidden)).astype(jnp.bfloat16)
    out = jax.jit(mf.moe_front)(x, params)
    assert out.ids.shape == (4, 4) and out.shared.shape == (4, DEEPSEEK.hidden)


@pytest.mark.parametrize("tp", [2, 4])
def test_deepseek_split_gate_and_up_load_straight_into_tp_shards(tmp_path, tp):
    layer = deepseek_layer(1)
    save_file({PREFIX + k: v for k, v in layer.items()}, str(tmp_path / "model.safetensors"))
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",),
                             axis_types=(jax.sharding.AxisType.Explicit,))
    params = mf.load_params(tmp_path, DEEPSEEK, prefix=PREFIX, mesh=mesh)
    want = mf.shard_params({k: jnp.asarray(v) for k, v in spec_weights(layer).items()}, DEEPSEEK, mesh)
    for name in ("packed", "bias", "gate_up", "down"):
        np.testing.assert_array_equal(np.asarray(getattr(params, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)


def test_mixtral_router_without_bias(tmp_path):
    rng = np.random.default_rng(2)
    prefix = "model.layers.0.block_sparse_moe."
    gate = bf16(rng, MIXTRAL.experts, MIXTRAL.hidden)
    save_file({prefix + "gate.weight": gate, prefix + "experts.0.w1.weight": bf16(rng, 16, 64)},
              str(tmp_path / "model.safetensors"))
    weights = mf.load_weights(tmp_path, MIXTRAL, prefix=prefix)
    assert_same(weights, {P.GATE: gate})
    params = mf.load_params(tmp_path, MIXTRAL, prefix=prefix)
    np.testing.assert_array_equal(np.asarray(params.bias), np.zeros(MIXTRAL.experts, np.float32))
    assert params.packed.shape == (16, MIXTRAL.hidden)  # 8 router rows, zero rows up to 16
    assert P.unpack_params(params).keys() == {P.GATE}


def test_missing_up_and_missing_bias_are_named(tmp_path):
    layer = deepseek_layer()
    del layer["shared_experts.up_proj.weight"]
    save_file({PREFIX + k: v for k, v in layer.items()}, str(tmp_path / "a.safetensors"))
    with pytest.raises(ValueError, match=f"checkpoint has no key '{PREFIX}shared_experts.up_proj"
                                         r".weight' \(expected \(32, 64\) bfloat16\)"):
        mf.load_weights(tmp_path / "a.safetensors", DEEPSEEK, prefix=PREFIX)
    layer = deepseek_layer()
    del layer["gate.e_score_correction_bias"]
    save_file({PREFIX + k: v for k, v in layer.items()}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match=f"checkpoint has no key '{PREFIX}gate.e_score_correction_"
                                         "bias'"):
        mf.load_weights(tmp_path / "b.safetensors", DEEPSEEK, prefix=PREFIX)
    # The same file loads as a config without a bias.
    no_bias = dataclasses.replace(DEEPSEEK, bias=False)
    assert P.BIAS not in mf.load_weights(tmp_path / "b.safetensors", no_bias, prefix=PREFIX)


def test_routed_experts_missing_or_misshapen_are_named(tmp_path):
    from moe_front_jax import layers

    rng = np.random.default_rng(4)
    prefix = "model.layers.0.block_sparse_moe."
    tensors = {}
    for e in range(MIXTRAL.experts):
        tensors.update({f"{prefix}experts.{e}.w1.weight": bf16(rng, 16, 64),
                        f"{prefix}experts.{e}.w3.weight": bf16(rng, 16, 64),
                        f"{prefix}experts.{e}.w2.weight": bf16(rng, 64, 16)})
    save_file(tensors, str(tmp_path / "ok.safetensors"))
    experts = layers.load_experts(tmp_path / "ok.safetensors", MIXTRAL, prefix)
    assert experts[layers.GATE_UP].shape == (8, 64, 32) and experts[layers.DOWN].shape == (8, 16, 64)
    np.testing.assert_array_equal(np.asarray(experts[layers.GATE_UP][5, :, 16:]).view(np.uint16),
                                  tensors[f"{prefix}experts.5.w3.weight"].T.view(np.uint16))
    del tensors[f"{prefix}experts.7.w2.weight"]
    tensors[f"{prefix}experts.3.w3.weight"] = bf16(rng, 8, 64)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=rf"'{prefix}experts.3.w3.weight' is \(8, 64\) bfloat16, "
                                         r"expected \(16, 64\) bfloat16"):
        layers.load_experts(tmp_path / "bad.safetensors", MIXTRAL, prefix)
    with pytest.raises(ValueError, match="checkpoint has no key 'x.experts.0.gate_proj.weight'"):
        layers.load_experts(tmp_path / "ok.safetensors", MIXTRAL, "x.")
    with pytest.raises(ValueError, match="hidden-space experts; the config has latent=64"):
        layers.load_experts(tmp_path / "ok.safetensors", dataclasses.replace(MIXTRAL, latent=64),
                            prefix)
