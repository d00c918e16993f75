"""The reference's products on a CPU: a one-row ``x`` runs XLA's dot on two rows (XLA's CPU dot of
bfloat16 is several times slower at one row; docs/findings.md).

What is checked: in the jaxpr traced for the CPU, every ``dot_general`` of the front GEMM and of the
shared expert at B = 1 has a left operand of 2 rows and the stage's outputs keep 1 row; at B = 2
nothing is padded; and row 0 equals a float64 numpy product to float32 rounding. Row 0's bits are
not compared with an unpadded dot (XLA may sum in another order on the two paths)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.reference.dot import rows_dot

CFG = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=128, shared=128)


def dot_rows(closed_jaxpr):
    """Rows of the left operand of every ``dot_general`` in a jaxpr (nested jaxprs included)."""
    rows = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                rows.append(eqn.invars[0].aval.shape[0])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return rows


@pytest.fixture(scope="module")
def params():
    assert jax.default_backend() == "cpu", "checks the CPU path (the suite runs on CPU)"
    return mf.pack_params(mf.init_weights(jax.random.key(0), CFG), CFG)


def stages(params):
    cfg = params.cfg
    return {
        "front_gemm": lambda x: reference.front_gemm(x, params.packed, params.split, cfg.experts),
        "shared_expert": lambda x: reference.shared_expert(x, params.gate_up, params.down, cfg),
        "front_gate_up": lambda x: reference.front_gate_up(
            x, params.packed, params.split, cfg.experts, params.gate_up, cfg),
    }


@pytest.mark.parametrize("stage", ["front_gemm", "shared_expert", "front_gate_up"])
def test_one_row_runs_the_cpu_dot_on_two_rows(params, stage):
    run = stages(params)[stage]
    for batch, want in ((1, 2), (2, 2), (3, 3)):
        x = jnp.zeros((batch, CFG.hidden), jnp.bfloat16)
        traced = jax.make_jaxpr(run)(x)
        rows = dot_rows(traced)
        assert rows and all(r == want for r in rows), (batch, rows)
        assert all(out.aval.shape[0] == batch for out in traced.jaxpr.outvars), batch


def test_one_row_product_equals_float64(params):
    x = jax.random.normal(jax.random.key(1), (1, CFG.hidden)).astype(jnp.bfloat16)
    got = np.asarray(jax.jit(rows_dot)(x, params.packed))
    want = np.asarray(x, np.float64) @ np.asarray(params.packed, np.float64).T
    assert got.shape == (1, params.packed.shape[0]) and got.dtype == np.float32
    # float32 accumulation of 256 products of bfloat16 values (exact in float32): a few ulps of the
    # sum of magnitudes.
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(params.packed, np.float64)).T
    assert np.all(np.abs(got - want) <= 256 * 2.0**-24 * scale)
