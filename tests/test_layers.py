"""``mf.layers.MoELayer`` for every preset but Kimi-K3 (tests/test_moe_layer_example.py runs K3's) at
its published sizes, against a float64 numpy layer that loops over tokens and their experts: the
routing by the numpy oracles (SPEC 4, 4.2, 4.3), each expert's SiLU-gated MLP on the token's own row
(no latent: the routed experts read ``x``), the SiLU shared expert (SPEC section 6).

The experts' intermediate is 8 (the presets' real ones, 768 to 14336, would need up to 15 GB of
expert weights on a CPU). Tolerance as in tests/test_moe_layer_example.py: the layer rounds the
routing weights, each expert's hidden activation, the shared gate, up and hidden, and the output to
bfloat16; ``2**-7`` of the output's norm, and elementwise ``2**-5`` of its RMS beyond the output's
own rounding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import layers
from moe_front_jax import params as packing
import oracle

INTERMEDIATE = 8
PRESETS = [name for name in mf.configs.PRESETS if name != "KIMI_K3"]


def numpy_layer(x, layer: layers.MoELayer):
    cfg = layer.cfg
    weights = {k: np.asarray(v) for k, v in packing.unpack_params(layer.front).items()}
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    x64 = f64(x)
    logits = (x64 @ f64(weights[packing.GATE]).T).astype(np.float32)
    if cfg.scoring == "softmax":
        ids, w = oracle.route_softmax(logits, cfg.top_k, cfg.routed_scaling_factor, cfg.renormalize)
    else:
        ids, w = oracle.route_grouped(logits, weights[packing.BIAS], cfg.top_k, cfg.groups,
                                      cfg.topk_groups, cfg.routed_scaling_factor, cfg.renormalize)
    gate_up, down = f64(layer.gate_up), f64(layer.down)
    out = np.zeros((len(x), cfg.hidden))
    for t in range(len(x)):
        for r in range(cfg.top_k):
            h = x64[t] @ gate_up[ids[t, r]]
            gate, up = h[:INTERMEDIATE], h[INTERMEDIATE:]
            out[t] += float(w[t, r]) * ((gate / (1.0 + np.exp(-gate)) * up) @ down[ids[t, r]])
    if cfg.shared:
        out += oracle.silu_shared_expert(x, weights[packing.GATE_UP], weights[packing.DOWN])
    return ids, out


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.gpu),
                                     pytest.param("auto", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", PRESETS)
def test_preset_layer_matches_float64_numpy(name, backend):
    """On the CPU the reference; on a GPU ``"pallas"`` and ``"auto"``, whatever kernels their plans
    take for the preset (``mf.explain``): the same ids, and the output within the same bound."""
    cfg = mf.configs.PRESETS[name]
    layer = layers.MoELayer.init(jax.random.key(0), cfg, INTERMEDIATE)
    x = jax.random.normal(jax.random.key(1), (3, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
    got, front = jax.jit(lambda lay, rows: lay(rows, backend=backend))(layer, x)
    assert got.shape == (3, cfg.hidden) and got.dtype == jnp.bfloat16
    want_ids, want = numpy_layer(np.asarray(x), layer)
    np.testing.assert_array_equal(np.asarray(front.ids), want_ids)
    assert int(front.dispatch.group_sizes.sum()) == 3 * cfg.top_k
    got = np.asarray(got).astype(np.float64)
    error = got - want
    assert np.linalg.norm(error) / np.linalg.norm(want) <= 2.0 ** -7
    beyond = np.abs(error) - 2.0 ** -8 * np.abs(want)
    assert beyond.max() <= 2.0 ** -5 * np.sqrt(np.mean(want ** 2))


SMALL = mf.FrontConfig(hidden=64, experts=16, top_k=4, latent=0, shared=32, groups=4, topk_groups=2,
                       activation="silu")


def test_plan_needs_a_latent():
    layer = layers.MoELayer.init(jax.random.key(0), SMALL, 8)
    with pytest.raises(ValueError, match="FrontConfig.latent is 0: a front without a latent has no "
                                         "plan"):
        layer(jnp.zeros((2, 64), jnp.bfloat16), plan=True)


def test_weights_that_do_not_fit_the_config_are_named():
    layer = layers.MoELayer.init(jax.random.key(0), SMALL, 8)
    with pytest.raises(ValueError, match=r"experts.down is \(16, 8, 32\) bfloat16, expected "
                                         r"\(16, 8, 64\) bfloat16"):
        dataclasses.replace(layer, down=jnp.zeros((16, 8, 32), jnp.bfloat16)).check()
    with pytest.raises(ValueError, match="routed_up_weight is given but the config has no latent"):
        dataclasses.replace(layer, routed_up=jnp.zeros((64, 32), jnp.bfloat16)).check()
    with_latent = dataclasses.replace(SMALL, latent=32)
    experts = layers.init_experts(jax.random.key(1), with_latent, 8)
    del experts[layers.ROUTED_UP]
    with pytest.raises(ValueError, match=r"routed_up_weight is None, expected \(64, 32\) bfloat16"):
        layers.MoELayer.create(mf.init_weights(jax.random.key(2), with_latent), experts, with_latent)


def test_layer_is_a_pytree_that_jit_traces_once():
    layer = layers.MoELayer.init(jax.random.key(0), SMALL, 8)
    leaves = jax.tree.leaves(layer)
    assert len(leaves) == 6  # packed, bias, gate_up, down of the front; the experts' gate_up, down
    traces = []

    @jax.jit
    def step(lay, rows):
        traces.append(1)
        return lay(rows, backend="xla")[0]

    x = jnp.ones((2, 64), jnp.bfloat16)
    step(layer, x)
    step(jax.tree.map(lambda a: a, layer), x)
    assert len(traces) == 1
