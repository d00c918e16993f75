"""``backend="auto"`` on a GPU: the GEMM kernels at the shapes where the device's auto table measured
them faster than XLA's reference stage, the reference elsewhere (lowered for an H200 from the CPU
host, with ``registry.on_gpu`` answering yes); and the shipped table is what
``benchmarks/auto_table.py`` makes of the committed benchmark runs it names."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

import moe_front_jax as mf
from moe_front_jax import registry
from moe_front_jax.params import padded_split
from moe_front_jax.pallas.front_gemm import kernel as fg
from moe_front_jax.pallas.shared_expert import kernel as se
from moe_front_jax.pallas import device
from conftest import has_gpu
from h200 import H200, lower_for_h200

ROOT = pathlib.Path(__file__).resolve().parents[1]
K3 = mf.KIMI_K3
KERNEL = "__gpu$xla.gpu.triton"
MOSAIC_KERNEL = "@mosaic_gpu_v2"
"""The custom calls of our Triton kernels and of the shared expert's TMA (Mosaic GPU) kernels."""


AUTO_KINDS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
"""The device kinds with an auto table (``pallas/tuning/<kind folder>/auto.json``)."""


def kernel_for_h200(name, *args):
    """Whether ``"auto"`` runs stage ``name``'s kernel for these arguments on an H200."""
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
        return registry.choose(name, "auto", *args).kernel


def auto_entries(stage):
    return device.tuning_entries(H200.device_kind, "auto")[stage]


def test_the_auto_tables_are_those_of_the_measured_kinds():
    folders = sorted(p.parent.name for p in (ROOT / "pallas" / "tuning").glob("*/auto.json"))
    assert folders == sorted(device.kind_folder(kind) for kind in AUTO_KINDS)
    assert device.tuning_entries("NVIDIA A100-SXM4-80GB", "auto") == {}


@pytest.mark.parametrize("kind", AUTO_KINDS)
def test_the_table_is_what_auto_table_makes_of_the_runs_it_names(monkeypatch, kind):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import auto_table

    path = ROOT / "pallas" / "tuning" / device.kind_folder(kind) / "auto.json"
    shipped = json.loads(path.read_text())
    assert shipped["device_kind"] == kind
    assert device.tuning_entries(kind, "auto") == shipped["entries"]
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
    assert not registry.on_gpu()
    cfg = K3.with_tp(8)
    valid, shard, s_r = cfg.experts_per_rank, cfg.latent_per_rank, cfg.shared_per_rank
    split = padded_split(valid)
    x = jax.ShapeDtypeStruct((1, K3.hidden), jnp.bfloat16)
    packed = jax.ShapeDtypeStruct((split + shard, K3.hidden), jnp.bfloat16)
    assert auto_entries("front_gemm")[fg.table_key(valid, shard, K3.hidden, 1)]["kernel"]
    assert not registry.choose("front_gemm", "auto", x, packed, split, valid).kernel
    gate_up = jax.ShapeDtypeStruct((2 * s_r, K3.hidden), jnp.bfloat16)
    down = jax.ShapeDtypeStruct((K3.hidden, s_r), jnp.bfloat16)
    assert auto_entries("shared_expert")[se.table_key(s_r, K3.hidden, 1)]["kernel"]
    assert not registry.choose("shared_expert", "auto", x, gate_up, down, cfg, jnp.float32).kernel
    assert not device.measured_faster("front_gemm", next(iter(auto_entries("front_gemm"))))


@pytest.mark.parametrize("tp", [1, 8])
def test_auto_front_gemm_is_the_kernel_where_the_table_says(monkeypatch, tp):
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    cfg = K3.with_tp(tp)
    valid, shard = cfg.experts_per_rank, cfg.latent_per_rank
    split = padded_split(valid)
    packed = jnp.zeros((split + shard, K3.hidden), jnp.bfloat16)
    for batch in (1, 3, 8, 16, 32, 256):
        entry = auto_entries("front_gemm").get(fg.table_key(valid, shard, K3.hidden, batch), {})
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        text = lower_for_h200(lambda x, w: registry.run("front_gemm", "auto", x, w, split, valid),
                              x, packed)
        want = entry.get("kernel", False)
        assert kernel_for_h200("front_gemm", x, packed, split, valid) == want, (tp, batch)
        assert (KERNEL in text) == want, (tp, batch)
        assert ("stablehlo.dot_general" in text) == (not want), (tp, batch)


@pytest.mark.parametrize("tp", [1, 8])
def test_auto_shared_expert_is_the_kernels_where_the_table_says(monkeypatch, tp):
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    cfg = K3.with_tp(tp)
    s_r = cfg.shared_per_rank
    gate_up = jnp.zeros((2 * s_r, K3.hidden), jnp.bfloat16)
    down = jnp.zeros((K3.hidden, s_r), jnp.bfloat16)
    dtype = jnp.bfloat16 if tp == 1 else jnp.float32
    for batch in (1, 2, 8, 64, 128):
        entry = auto_entries("shared_expert").get(se.table_key(s_r, K3.hidden, batch), {})
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        text = lower_for_h200(
            lambda x, g, d: registry.run("shared_expert", "auto", x, g, d, cfg, dtype), x, gate_up, down)
        want = entry.get("kernel", False)
        assert kernel_for_h200("shared_expert", x, gate_up, down, cfg, dtype) == want, (tp, batch)
        assert text.count(KERNEL) + text.count(MOSAIC_KERNEL) == (2 if want else 0), (tp, batch)
        assert ("stablehlo.dot_general" in text) == (not want), (tp, batch)


def test_auto_moe_front_takes_the_kernel_at_b1_and_xla_at_b8(monkeypatch):
    """The whole front on ``"auto"`` at tp1: the GEMM kernel and the routing kernel at B=1, where
    the table has the kernel; XLA's dot and the routing kernel at B=8, where it has XLA; the shared
    expert's two TMA kernels at both, as the table has them at tp1."""
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
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
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    assert not fg.auto_prefers_kernel(jnp.zeros((7168,), jnp.bfloat16), jnp.zeros((8, 7168)), 0, 8)
    assert not se.auto_prefers_kernel(jnp.zeros((0, 64), jnp.bfloat16), None, jnp.zeros((64, 8)),
                                      K3)
