"""``backend="auto"`` on a GPU: the GEMM kernels at the shapes where the device's auto table measured
them faster than XLA's reference stage, the reference elsewhere (lowered for an H200 from the CPU
host, with ``backends.on_gpu`` answering yes); and the shipped table is what
``benchmarks/auto_table.py`` makes of the committed benchmark runs it names."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import moe_front_jax as mf
from moe_front_jax import backends
from moe_front_jax.params import padded_split
from moe_front_jax.pallas import front_gemm as fg
from moe_front_jax.pallas import shared_expert as se
from moe_front_jax.pallas import streaming
from conftest import has_gpu
from h200 import H200, lower_for_h200

ROOT = pathlib.Path(__file__).resolve().parents[1]
K3 = mf.KIMI_K3
KERNEL = "__gpu$xla.gpu.triton"
MOSAIC_KERNEL = "@mosaic_gpu_v2"
"""The custom calls of our Triton kernels and of the shared expert's TMA (Mosaic GPU) kernels."""


def auto_entries(stage):
    return streaming.table_entries(streaming.AUTO_FILES[H200.device_kind])[stage]


@pytest.mark.parametrize("kind", sorted(streaming.AUTO_FILES))
def test_the_table_is_what_auto_table_makes_of_the_runs_it_names(monkeypatch, kind):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import auto_table

    shipped = json.loads((ROOT / "pallas" / "tuning" / streaming.AUTO_FILES[kind]).read_text())
    assert shipped["device_kind"] == kind
    assert shipped["margin"] == auto_table.MARGIN
    for run in shipped["front"] + shipped["shared"]:  # measured on that kind
        assert json.loads((ROOT / auto_table.run_file(run)[0]).read_text())["device"] == kind, run
    rebuilt = auto_table.build([str(ROOT / p) for p in shipped["front"]],
                               [str(ROOT / p) for p in shipped["shared"]])
    assert rebuilt == shipped["entries"]
    flags = [e["kernel"] for e in shipped["entries"]["front_gemm"].values()]
    assert any(flags) and not all(flags)  # both choices occur: the test below sees both
    # The shared expert's kernels won at every batch measured (B <= 64); its test below sees XLA at
    # B=128, which no run measured.
    assert any(e["kernel"] for e in shipped["entries"]["shared_expert"].values())
    assert se.table_key(768, K3.hidden, 128) not in shipped["entries"]["shared_expert"]


def test_the_rule_needs_the_margin_in_every_run(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import auto_table

    key = "valid=8,shard=8,hidden=64,batch=1"
    assert auto_table.choices([{key: (10.0, 10.6)}, {key: (10.0, 11.0)}])[key]["kernel"]
    assert not auto_table.choices([{key: (10.0, 10.4)}, {key: (10.0, 11.0)}])[key]["kernel"]
    assert not auto_table.choices([{key: (10.0, 9.0)}])[key]["kernel"]


@pytest.mark.skipif(has_gpu(), reason="checks what auto picks on a machine without a GPU")
def test_off_the_gpu_auto_is_the_reference():
    assert not backends.on_gpu()
    for name in ("front_gemm", "shared_expert"):
        assert backends.stage(name, "auto") is backends.REFERENCE[name]
    assert not streaming.measured_faster("front_gemm", next(iter(auto_entries("front_gemm"))))


@pytest.mark.parametrize("tp", [1, 8])
def test_auto_front_gemm_is_the_kernel_where_the_table_says(monkeypatch, tp):
    monkeypatch.setattr(backends, "on_gpu", lambda: True)
    cfg = K3.with_tp(tp)
    valid, shard = cfg.experts_per_rank, cfg.latent_per_rank
    split = padded_split(valid)
    packed = jnp.zeros((split + shard, K3.hidden), jnp.bfloat16)
    gemm = backends.stage("front_gemm", "auto")
    assert gemm is not backends.REFERENCE["front_gemm"]
    for batch in (1, 3, 8, 16, 32, 256):
        entry = auto_entries("front_gemm").get(fg.table_key(valid, shard, K3.hidden, batch), {})
        text = lower_for_h200(lambda x, w: gemm(x, w, split, valid),
                              jnp.zeros((batch, K3.hidden), jnp.bfloat16), packed)
        want = entry.get("kernel", False)
        assert (KERNEL in text) == want, (tp, batch)
        assert ("stablehlo.dot_general" in text) == (not want), (tp, batch)


@pytest.mark.parametrize("tp", [1, 8])
def test_auto_shared_expert_is_the_kernels_where_the_table_says(monkeypatch, tp):
    monkeypatch.setattr(backends, "on_gpu", lambda: True)
    cfg = K3.with_tp(tp)
    s_r = cfg.shared_per_rank
    gate_up = jnp.zeros((2 * s_r, K3.hidden), jnp.bfloat16)
    down = jnp.zeros((K3.hidden, s_r), jnp.bfloat16)
    shared = backends.stage("shared_expert", "auto")
    dtype = jnp.bfloat16 if tp == 1 else jnp.float32
    for batch in (1, 2, 8, 64, 128):
        entry = auto_entries("shared_expert").get(se.table_key(s_r, K3.hidden, batch), {})
        text = lower_for_h200(lambda x, g, d: shared(x, g, d, cfg, dtype),
                              jnp.zeros((batch, K3.hidden), jnp.bfloat16), gate_up, down)
        want = entry.get("kernel", False)
        assert text.count(KERNEL) + text.count(MOSAIC_KERNEL) == (2 if want else 0), (tp, batch)
        assert ("stablehlo.dot_general" in text) == (not want), (tp, batch)


def test_auto_moe_front_takes_the_kernel_at_b1_and_xla_at_b8(monkeypatch):
    """The whole front on ``"auto"`` at tp1: the GEMM kernel and the routing kernel at B=1, where
    the table has the kernel; XLA's dot and the routing kernel at B=8, where it has XLA; the shared
    expert's two TMA kernels at both, as the table has them at tp1."""
    monkeypatch.setattr(backends, "on_gpu", lambda: True)
    assert auto_entries("front_gemm")[fg.table_key(896, 3584, 7168, 1)]["kernel"]
    assert not auto_entries("front_gemm")[fg.table_key(896, 3584, 7168, 8)]["kernel"]
    for batch in (1, 8):
        assert auto_entries("shared_expert")[se.table_key(6144, 7168, batch)]["kernel"]
    params = mf.pack_params(mf.init_weights(jax.random.key(0), K3), K3)
    for batch, kernels in ((1, ["front_gemm", "route"]), (8, ["route"])):
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        text = lower_for_h200(lambda x, p: mf.moe_front(x, p, backend="auto"), x, params)
        assert text.count(KERNEL) == len(kernels), batch
        assert sorted(re.findall(r'name = "(\w+)", num_stages', text)) == sorted(kernels), batch
        assert text.count(MOSAIC_KERNEL) == 2, batch
        assert ("stablehlo.dot_general" in text) == (batch == 8)  # the GEMM's at B=8


def test_malformed_arguments_take_the_reference(monkeypatch):
    """The predicates do not index shapes they were not given: the reference then raises its own
    error (moe_front checks its arguments before any stage runs)."""
    monkeypatch.setattr(backends, "on_gpu", lambda: True)
    assert not fg.auto_prefers_kernel(jnp.zeros((7168,), jnp.bfloat16), jnp.zeros((8, 7168)), 0, 8)
    assert not se.auto_prefers_kernel(jnp.zeros((0, 64), jnp.bfloat16), None, jnp.zeros((64, 8)),
                                      K3)
