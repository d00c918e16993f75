"""examples/decode.py, the README's main job: decode steps through mf.nn.MoEFront."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

import moe_front_jax as mf

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "decode.py"


def load_example():
    spec = importlib.util.spec_from_file_location("decode_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_steps_print_a_progress_line_each_and_hold_the_invariants(capsys):
    assert load_example().main(["--small", "--batch", "3", "--steps", "2", "--backend", "xla"]) == 0
    out = capsys.readouterr().out
    assert "B=3: 2 decode steps" in out
    steps = [line.strip() for line in out.splitlines() if line.strip().startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/2:", "2/2:"]
    assert all(line.endswith("invariants hold") for line in steps)
    assert out.rstrip().endswith("all invariants hold")


def test_invariant_check_catches_a_repeated_expert():
    example = load_example()
    cfg = mf.FrontConfig(hidden=64, experts=32, top_k=4, latent=64, shared=32)
    weights = mf.init_weights(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (2, cfg.hidden)).astype(jnp.bfloat16)
    out = jax.jit(mf.moe_front, static_argnames="plan")(x, mf.pack_params(weights, cfg), plan=True)
    bias = weights["gate.e_score_correction_bias"]
    assert example.invariant_failures(out, bias, cfg, 2) == []
    repeated = out._replace(ids=out.ids.at[1, 3].set(out.ids[1, 0]))
    assert "a row with a repeated expert id" in example.invariant_failures(repeated, bias, cfg, 2)
