"""examples/moe_layer.py, one whole MoE layer, against a float64 numpy layer written here: the routing
of SPEC section 4 and the MXFP8 plan of section 5 by the numpy oracles (tests/oracle.py), then a loop
over the tokens and their K experts, each expert's MLP on the token's own row, no permutation.

Tolerance. The layer rounds to bfloat16 where a real one would: the latent (the SPEC's rounding, which
the numpy layer applies too: a float32 accumulation and a float64 one can round an element one ulp
apart), each expert's hidden activation, the routed sum, the shared expert's gate, up and hidden (SPEC
section 6, applied by the oracle too), and the output. A bfloat16 rounding of ``v`` errs by at most
half an ulp, ``2**-8 |v|`` (8 significant bits), RMS ``ulp / sqrt(12) <= 2**-7 / sqrt(12) |v|``
(0.23%) for errors uniform in the half-ulp. Three roundings on the routed path (hidden, routed sum,
output), each carried on by dot products with random signs that keep relative RMS errors relative,
give at most ``sqrt(3) * 0.23% = 0.4%`` of the output's norm; the test allows ``2**-7`` (0.78%),
twice that. Elementwise, an output element errs by its own final rounding (``2**-8 |y|``) plus its
share of the path's errors: at most ``2**-5`` of the output's RMS beyond the final rounding (6
sigma of the 0.4%-of-RMS path error)."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_front_jax as mf
import oracle
import scripts

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"
BF16 = ml_dtypes.bfloat16
SMALL = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=128, shared=256)


@functools.cache
def example():
    return scripts.load(SCRIPT, "moe_layer_example")


def numpy_weights(cfg, intermediate, seed):
    """The front's weights (SPEC keys) and the routed experts' (the example's keys), bfloat16
    normals / sqrt(fan in) drawn by numpy (faster than jax.random for K3's 1.2 GB)."""
    rng = np.random.default_rng(seed)

    def normal(shape, fan_in):
        return (rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(fan_in))).astype(BF16)

    e, h, latent, s, i = cfg.experts, cfg.hidden, cfg.latent, cfg.shared, intermediate
    front = {
        "gate.weight": normal((e, h), h),
        "gate.e_score_correction_bias": rng.uniform(-0.05, 0.05, e).astype(np.float32),
        "routed_down_weight": normal((latent, h), h),
        "shared_experts.gate_up_proj.weight": normal((2 * s, h), h),
        "shared_experts.down_proj.weight": normal((h, s), s),
    }
    ex = example()
    experts = {ex.GATE_UP: normal((e, latent, 2 * i), latent), ex.DOWN: normal((e, i, latent), i),
               ex.ROUTED_UP: normal((h, latent), latent)}
    return front, experts


def numpy_layer(x, front, experts, cfg, plan: bool):
    """The layer in float64 numpy: ids, and the output ``[B, H]``."""
    ex = example()
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    x64 = f64(x)
    logits = (x64 @ f64(front["gate.weight"]).T).astype(np.float32)
    ids, weights = oracle.route(logits, front["gate.e_score_correction_bias"], cfg.top_k,
                                cfg.routed_scaling_factor, cfg.renormalize)
    latent = (x64 @ f64(front["routed_down_weight"]).T).astype(BF16)  # SPEC section 3's rounding
    if plan:
        values, scale_bytes = oracle.mxfp8_plan(latent, cfg.plan_block)
        scale = np.exp2(scale_bytes.astype(np.float64) - 127.0)
        rows = (f64(values).reshape(len(x), -1, cfg.plan_block) * scale[..., None]).reshape(len(x), -1)
    else:
        rows = f64(latent)
    gate_up, down = experts[ex.GATE_UP], experts[ex.DOWN]
    i = down.shape[1]
    routed = np.zeros((len(x), cfg.latent))
    for t in range(len(x)):
        for r in range(cfg.top_k):
            e = ids[t, r]
            h = rows[t] @ f64(gate_up[e])
            gate, up = h[:i], h[i:]
            hidden = gate / (1.0 + np.exp(-gate)) * up
            routed[t] += float(weights[t, r]) * (hidden @ f64(down[e]))
    out = routed @ f64(experts[ex.ROUTED_UP]).T
    if cfg.shared:
        out += oracle.shared_expert(x, front["shared_experts.gate_up_proj.weight"],
                                    front["shared_experts.down_proj.weight"])
    return ids, out


def check(cfg, batch, intermediate, plan, backend="xla", seed=0):
    front, experts = numpy_weights(cfg, intermediate, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((batch, cfg.hidden), np.float32).astype(BF16)
    params = mf.pack_params({k: jnp.asarray(v) for k, v in front.items()}, cfg)
    layer = jax.jit(functools.partial(example().moe_layer, plan=plan, backend=backend))
    got, out = layer(jnp.asarray(x), params, {k: jnp.asarray(v) for k, v in experts.items()})
    got = np.asarray(got).astype(np.float64)
    want_ids, want = numpy_layer(x, front, experts, cfg, plan)
    np.testing.assert_array_equal(np.asarray(out.ids), want_ids)
    assert out.dispatch is not None and int(out.dispatch.group_sizes.sum()) == batch * cfg.top_k
    error = got - want
    rms = np.sqrt(np.mean(want ** 2))
    relative = np.linalg.norm(error) / np.linalg.norm(want)
    assert relative <= 2.0 ** -7, relative
    beyond = np.abs(error) - 2.0 ** -8 * np.abs(want)
    assert beyond.max() <= 2.0 ** -5 * rms, (beyond.max() / rms)
    return relative, beyond.max() / rms


@pytest.mark.parametrize("plan", [True, False])
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_small_layer_matches_float64_numpy(plan, backend):
    for batch in (1, 5):
        check(SMALL, batch, 64, plan, backend, seed=batch)


def test_kimi_k3_layer_matches_float64_numpy():
    """K3's shapes (896 experts, top-16, H 7168, L 3584, S 6144), B = 2, intermediate 64."""
    check(mf.KIMI_K3, 2, 64, plan=True)


def test_script_runs_small(capsys):
    assert example().main(["--small", "--batch", "3", "--backend", "xla"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("ok")
