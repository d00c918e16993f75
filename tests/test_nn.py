"""mf.nn.MoEFront: the NNX module against mf.moe_front, alone and inside a small decode model."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_front_jax as mf
from moe_front_jax import params as P

CFG = mf.FrontConfig(hidden=128, experts=64, top_k=8, latent=128, shared=64)


def rows(batch, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, CFG.hidden)).astype(jnp.bfloat16)


def assert_outputs_equal(got: mf.FrontOutput, want: mf.FrontOutput):
    for name in ("ids", "weights", "latent", "logits", "shared", "status"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    if want.plan is None:
        assert got.plan is None
    else:
        for a, b in zip(got.plan, want.plan):
            np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8)), np.asarray(b.view(jnp.uint8)))


@functools.partial(jax.jit, static_argnames="plan")
def reference_front(x, params, plan=False):
    return mf.moe_front(x, params, plan=plan, backend="xla")


@pytest.mark.parametrize("shared, plan", [(True, True), (False, False)])
def test_module_matches_moe_front(shared, plan):
    weights = mf.init_weights(jax.random.key(0), CFG, shared=shared)
    front = mf.nn.MoEFront(CFG, weights=weights)
    x = rows(5)
    want = reference_front(x, mf.pack_params(weights, CFG), plan=plan)
    assert_outputs_equal(nnx.jit(lambda m, x: m(x, plan=plan))(front, x), want)


def test_module_called_eagerly():
    weights = mf.init_weights(jax.random.key(0), CFG)
    x = rows(3)
    assert_outputs_equal(mf.nn.MoEFront(CFG, weights=weights)(x), reference_front(x, mf.pack_params(weights, CFG)))


def test_rngs_draw_init_weights():
    front = mf.nn.MoEFront(CFG, rngs=nnx.Rngs(params=3))
    want = mf.init_weights(nnx.Rngs(params=3).params(), CFG)
    got = front.weights()
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    assert mf.nn.MoEFront(CFG, rngs=nnx.Rngs(0), shared=False).shared_experts is None


def test_params_carry_names_shapes_and_tp_annotations():
    front = mf.nn.MoEFront(CFG, rngs=nnx.Rngs(0))
    state = nnx.state(front, nnx.Param)
    flat = {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}
    h, e, lat, s = CFG.hidden, CFG.experts, CFG.latent, CFG.shared
    expected = {
        "gate.weight": ((e, h), jnp.bfloat16, ("tp", None)),
        "gate.e_score_correction_bias": ((e,), jnp.float32, (None,)),
        "routed_down_weight": ((lat, h), jnp.bfloat16, ("tp", None)),
        "shared_experts.gate_up_proj.weight": ((2, s, h), jnp.bfloat16, (None, "tp", None)),
        "shared_experts.down_proj.weight": ((h, s), jnp.bfloat16, (None, "tp")),
    }
    assert set(flat) == set(expected)
    specs = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.get_partition_spec(state))}
    for name, (shape, dtype, sharding) in expected.items():
        assert flat[name].shape == shape and flat[name].dtype == dtype, name
        assert flat[name].get_metadata()["out_sharding"] == sharding, name
        assert specs[name].get_value() == jax.sharding.PartitionSpec(*sharding), name


def test_gate_up_view_keeps_gate_rows_then_up_rows():
    weights = mf.init_weights(jax.random.key(0), CFG)
    front = mf.nn.MoEFront(CFG, weights=weights)
    held = np.asarray(front.shared_experts.gate_up_proj.weight[...])
    fused = np.asarray(weights[P.GATE_UP])
    np.testing.assert_array_equal(held[0], fused[: CFG.shared])
    np.testing.assert_array_equal(held[1], fused[CFG.shared:])


class TinyDecoder(nnx.Module):
    """A toy decode model: token embedding, RMSNorm, the MoE front, a routed expert table, a head."""

    def __init__(self, cfg, vocab, rngs, mesh=None):
        replicate = (lambda a: a) if mesh is None else (
            lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
        self.embed = nnx.Embed(vocab, cfg.hidden, rngs=rngs)
        self.norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.front = mf.nn.MoEFront(cfg, rngs=rngs, mesh=mesh)
        self.experts = nnx.Param(jax.random.normal(rngs.params(), (cfg.experts, cfg.hidden)) * 0.1)
        self.head = nnx.Linear(cfg.hidden, vocab, rngs=rngs)
        for module in (self.embed, self.norm, self.head, self):
            for name, value in vars(module).items():
                if isinstance(value, nnx.Param):
                    value.set_value(replicate(value[...]))

    def rows(self, tokens):
        return self.norm(self.embed(tokens)).astype(jnp.bfloat16)

    def __call__(self, tokens):
        x = self.rows(tokens)
        out = self.front(x)
        routed = jnp.einsum("bk,bkh->bh", out.weights.astype(jnp.float32), self.experts[...][out.ids])
        hidden = x.astype(jnp.float32) + routed + out.shared.astype(jnp.float32)
        return out, jnp.argmax(self.head(hidden), axis=-1)


def test_front_inside_a_decode_model_under_nnx_jit():
    model = TinyDecoder(CFG, vocab=97, rngs=nnx.Rngs(0))
    step = nnx.jit(lambda m, tokens: m(tokens))
    params = mf.pack_params(model.front.weights(), CFG)
    tokens = jnp.array([3, 14, 15, 92, 65, 35], jnp.int32)
    for _ in range(3):
        out, next_tokens = step(model, tokens)
        assert_outputs_equal(out, reference_front(model.rows(tokens), params))
        assert next_tokens.shape == tokens.shape and next_tokens.dtype == jnp.int32
        tokens = next_tokens


def test_bad_arguments_raise_value_error():
    weights = mf.init_weights(jax.random.key(0), CFG)
    with pytest.raises(ValueError, match="exactly one of rngs"):
        mf.nn.MoEFront(CFG)
    with pytest.raises(ValueError, match="exactly one of rngs"):
        mf.nn.MoEFront(CFG, rngs=nnx.Rngs(0), weights=weights)
    with pytest.raises(ValueError, match="backend must be one of"):
        mf.nn.MoEFront(CFG, weights=weights, backend="cuda")
    with pytest.raises(ValueError, match="shared=True needs"):
        mf.nn.MoEFront(mf.FrontConfig(hidden=128, experts=64, top_k=8, latent=128, shared=0),
                       rngs=nnx.Rngs(0))
    bad = dict(weights, **{P.ROUTED_DOWN: weights[P.ROUTED_DOWN][:-1]})
    with pytest.raises(ValueError, match=re.escape(repr(P.ROUTED_DOWN))):
        mf.nn.MoEFront(CFG, weights=bad)
    front = mf.nn.MoEFront(CFG, weights=weights)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        front(rows(2).astype(jnp.float32))


def tp_mesh(tp, names=("tp",), shape=None):
    devices = np.array(jax.devices()[: math.prod(shape or (tp,))]).reshape(shape or (tp,))
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(names))


@pytest.mark.parametrize("tp", [2, 8])
def test_module_on_a_tp_mesh_matches_moe_front(tp):
    weights = mf.init_weights(jax.random.key(0), CFG)
    front = mf.nn.MoEFront(CFG, weights=weights, mesh=tp_mesh(tp))
    assert front.cfg.tp == tp
    valid, s_r = CFG.experts // tp, CFG.shared // tp
    fused = np.asarray(weights[P.GATE_UP])
    for r, device in enumerate(front.gate.weight[...].sharding.mesh.devices.flat):
        gate = next(s for s in front.gate.weight[...].addressable_shards if s.device == device)
        np.testing.assert_array_equal(np.asarray(gate.data), np.asarray(weights[P.GATE][r * valid:(r + 1) * valid]))
        gate_up = next(s for s in front.shared_experts.gate_up_proj.weight[...].addressable_shards
                       if s.device == device)
        want = np.stack([fused[r * s_r:(r + 1) * s_r], fused[CFG.shared + r * s_r:CFG.shared + (r + 1) * s_r]])
        np.testing.assert_array_equal(np.asarray(gate_up.data), want)
    x = rows(5)
    got = nnx.jit(lambda m, x: m(x, plan=True))(front, x)
    want = reference_front(x, mf.pack_params(weights, CFG), plan=True)
    # The shared expert's partial sums are added in another order than one device's accumulation.
    np.testing.assert_allclose(np.asarray(got.shared, np.float32), np.asarray(want.shared, np.float32),
                               rtol=2.0**-7, atol=2.0**-10)
    assert_outputs_equal(got._replace(shared=want.shared), want)
    for name, array in front.weights().items():
        np.testing.assert_array_equal(np.asarray(array), np.asarray(weights[name]), err_msg=name)


def test_decode_model_with_a_tp_front_under_nnx_jit():
    mesh = tp_mesh(4)
    model = TinyDecoder(CFG, vocab=97, rngs=nnx.Rngs(0), mesh=mesh)
    tokens = jnp.array([3, 14, 15, 92], jnp.int32)
    step = nnx.jit(lambda m, tokens: m(tokens))
    one_device = mf.pack_params(jax.device_get(model.front.weights()), CFG)
    for _ in range(2):
        out, next_tokens = step(model, tokens)
        want = reference_front(jax.device_get(model.rows(tokens)), one_device)
        np.testing.assert_array_equal(np.asarray(out.ids), np.asarray(want.ids))
        np.testing.assert_array_equal(np.asarray(out.latent), np.asarray(want.latent))
        tokens = next_tokens


def test_data_axis_beside_tp_and_psum_scatter():
    weights = mf.init_weights(jax.random.key(0), CFG)
    mesh = tp_mesh(4, names=("data", "tp"), shape=(2, 4))
    front = mf.nn.MoEFront(CFG, weights=weights, mesh=mesh, shared_reduce="psum_scatter")
    call = nnx.jit(lambda m, x: m(x))
    got = call(front, jax.device_put(rows(6), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))))
    np.testing.assert_array_equal(np.asarray(call(front, rows(6)).ids), np.asarray(got.ids))  # x on one device
    want = reference_front(rows(6), mf.pack_params(weights, CFG))
    assert got.shared.sharding.spec == jax.sharding.PartitionSpec("data", "tp")
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids))
    np.testing.assert_allclose(np.asarray(got.shared, np.float32), np.asarray(want.shared, np.float32),
                               rtol=2.0**-7, atol=2.0**-10)
    with pytest.raises(ValueError, match="B must be divisible by 2"):
        call(front, rows(3))


def test_tp_arguments_raise_value_error():
    weights = mf.init_weights(jax.random.key(0), CFG)
    with pytest.raises(ValueError, match="cfg.tp=2 needs mesh="):
        mf.nn.MoEFront(CFG.with_tp(2), weights=weights)
    with pytest.raises(ValueError, match="axis='model' is not an axis of the mesh"):
        mf.nn.MoEFront(CFG, weights=weights, mesh=tp_mesh(2), axis="model")
    with pytest.raises(ValueError, match="cfg.tp=4 disagrees with mesh axis 'tp' of size 2"):
        mf.nn.MoEFront(CFG.with_tp(4), weights=weights, mesh=tp_mesh(2))
    with pytest.raises(ValueError, match="shared_reduce must be one of"):
        mf.nn.MoEFront(CFG, weights=weights, shared_reduce="sum")
