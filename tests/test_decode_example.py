"""The README's main job: decode steps through mf.nn.MoEFront (``moe_front_jax.demo``, run by
``examples/decode.py``, ``make demo`` and the ``moe-front-demo`` console script)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import moe_front_jax as mf
from moe_front_jax import demo
import scripts

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "decode.py"


def load_example():
    return scripts.load(SCRIPT, "decode_example")


def test_decode_steps_print_a_progress_line_each_and_hold_the_invariants(capsys):
    example = load_example()
    assert example.main is demo.main
    assert example.main(["--small", "--batch", "3", "--steps", "2", "--backend", "xla"]) == 0
    out = capsys.readouterr().out
    assert "moe_front plan: one device, B=3, backend='xla'" in out  # the plan, printed once
    assert re.search(r"^1  front_gemm +reference\.gemm\.front_gemm +backend='xla'$", out, re.M), out
    assert out.count("moe_front plan:") == 1
    assert "B=3: 2 decode steps" in out
    steps = [line.strip() for line in out.splitlines() if line.strip().startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/2:", "2/2:"]
    assert all(line.endswith("invariants hold") for line in steps)
    assert out.rstrip().endswith("all invariants hold")


def test_progress_line_gives_row_0s_latent_norm():
    """Row 0's latent holds 4 values of 3 (norm 6.0), row 1's values of 100: the line says 6.0."""
    cfg = mf.FrontConfig(hidden=64, experts=32, top_k=4, latent=64, shared=32)
    latent = jnp.zeros((2, cfg.latent), jnp.bfloat16).at[0, :4].set(3).at[1].set(100)
    ids = jnp.tile(jnp.arange(cfg.top_k, dtype=jnp.int32), (2, 1))
    out = mf.FrontOutput(ids, jnp.ones((2, cfg.top_k), jnp.bfloat16), latent,
                         jnp.zeros((2, cfg.experts)), None, None, jnp.zeros((), jnp.int32))
    line = demo.progress(0.0125, out, np.array([7, 8]), [])
    assert "row 0: experts 0 1 2 .., latent norm 6.0 " in line, line
    assert line.endswith("next 7 8  invariants hold") and line.startswith("   12.5 ms")


def test_invariant_check_catches_a_repeated_expert():
    cfg = mf.FrontConfig(hidden=64, experts=32, top_k=4, latent=64, shared=32)
    weights = mf.init_weights(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (2, cfg.hidden)).astype(jnp.bfloat16)
    out = jax.jit(mf.moe_front, static_argnames="plan")(x, mf.pack_params(weights, cfg), plan=True)
    bias = weights["gate.e_score_correction_bias"]
    assert demo.invariant_failures(out, bias, cfg, 2) == []
    repeated = out._replace(ids=out.ids.at[1, 3].set(out.ids[1, 0]))
    assert "a row with a repeated expert id" in demo.invariant_failures(repeated, bias, cfg, 2)
