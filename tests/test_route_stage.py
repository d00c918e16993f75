"""The routing stage's kernel (``pallas/route/stage.py``): which of the two routing kernels
``selects`` names for each family, with the dispatch order and without, at the rule's edges (384
experts, Mosaic's 256 rows of order, E not 32 n), and where neither covers; ``registry.choose`` and
``mf.explain`` naming it; ``"pallas"`` lowered for an H200 to the named kernel alone; ``mf.route``
on ``"interpret"`` bit-equal to ``"xla"`` for a softmax family and a sigmoid one; on the GPU, the
stage's bits those of the kernel it names."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import registry
from moe_front_jax.pallas.route import kernel as rk
from moe_front_jax.pallas.route import mosaic as mr
from moe_front_jax.pallas.route import stage
from bitwise import assert_each_bits_equal
from h200 import lower_for_h200

PRESETS = mf.configs.PRESETS
MOSAIC, TRITON = "mosaic_route", "triton_route"
RULE = [
    ("DEEPSEEK_V3", False, MOSAIC, "groups or softmax"),
    ("DEEPSEEK_V3", True, MOSAIC, "groups or softmax"),
    ("QWEN3_30B_A3B", False, MOSAIC, "groups or softmax"),
    ("QWEN3_30B_A3B", True, MOSAIC, "groups or softmax"),
    ("KIMI_K2", False, MOSAIC, "sigmoid over 384 <= 384 experts"),
    ("KIMI_K2", True, TRITON, "the dispatch order in the routing launch"),
    ("GLM_4_5", False, MOSAIC, "sigmoid over 160 <= 384 experts"),
    ("GLM_4_5", True, TRITON, "the dispatch order in the routing launch"),
    ("KIMI_K3", False, TRITON, "896 > 384 experts"),
    ("KIMI_K3", True, TRITON, "the dispatch order in the routing launch"),
]
"""(preset, permute, the kernel the rule names, words of its reason), written out by hand."""


def shapes(batch, cfg):
    return (jax.ShapeDtypeStruct((batch, cfg.experts), jnp.float32),
            jax.ShapeDtypeStruct((cfg.experts,), jnp.float32))


@pytest.mark.parametrize("name, permute, implementation, reason", RULE)
def test_selects_per_the_measured_rule(name, permute, implementation, reason):
    cfg = PRESETS[name]
    selection = stage.selects(*shapes(8, cfg), cfg, permute=permute)
    assert selection.implementation == implementation and reason in selection.reason
    assert isinstance(selection.config, mr.MosaicRouteConfig if implementation == MOSAIC
                      else rk.RouteConfig)
    stage.covers(*shapes(8, cfg), cfg, permute=permute)


def plain(experts):
    return mf.FrontConfig(hidden=64, experts=experts, top_k=8, latent=0, shared=0)


@pytest.mark.parametrize("cfg, batch, permute, implementation, reason", [
    (plain(384), 1, False, MOSAIC, "sigmoid over 384 <= 384"),
    (plain(416), 1, False, TRITON, "416 > 384 experts"),
    (plain(100), 1, False, TRITON, "the Mosaic kernel does not cover this: .*experts=100 is not 32"),
    (PRESETS["KIMI_K2"], 300, True, TRITON, "the Mosaic kernel .*covers up to 256 rows, got B=300"),
], ids=["e384", "e416", "e100", "k2_order_b300"])
def test_selects_at_the_rule_edges(cfg, batch, permute, implementation, reason):
    """The largest E Mosaic takes and the next 32 n; E not 32 n; an order past Mosaic's 256 rows
    where the Triton kernel writes it."""
    selection = stage.selects(*shapes(batch, cfg), cfg, permute=permute)
    assert selection.implementation == implementation and re.search(reason, selection.reason)


def test_covers_refuses_only_where_both_kernels_do():
    """Mixtral's 8 experts with softmax, DeepSeek-V3's order past 256 rows, 8192 experts: a
    ``NotImplementedError`` naming both kernels' reasons; wrong arguments a ``ValueError``."""
    mixtral, deepseek = PRESETS["MIXTRAL_8X7B"], PRESETS["DEEPSEEK_V3"]
    wide = plain(8192)
    for cfg, batch, permute, words in (
            (mixtral, 8, False, ("experts=8 is not 32 \\* n", "scoring='softmax'")),
            (deepseek, 257, True, ("covers up to 256 rows, got B=257", "topk_groups=4")),
            (wide, 1, False, ("up to 4096 experts", "up to 4096 experts"))):
        match = f"neither routing kernel covers this \\(Mosaic: .*{words[0]}.*; Triton: .*{words[1]}"
        with pytest.raises(NotImplementedError, match=match):
            stage.covers(*shapes(batch, cfg), cfg, permute=permute)
        assert not registry.choose("route", "auto", *shapes(batch, cfg), cfg, permute=permute).kernel
    with pytest.raises(ValueError, match=r"logits must be \[B, experts=256\] float32"):
        stage.selects(jax.ShapeDtypeStruct((8, 256), jnp.bfloat16), shapes(8, deepseek)[1], deepseek)


def test_the_registry_and_the_plan_name_the_kernel():
    """``"interpret"`` runs the stage's kernel and reports the one it names; the plan of a
    DeepSeek-V3 front says ``mosaic_route``, of a Mixtral one that the reference runs and why."""
    stage_entry = registry.STAGES["route"]
    assert stage_entry.kernel == "moe_front_jax.pallas.route.stage:route"
    assert stage_entry.selects == "moe_front_jax.pallas.route.stage:selects"
    deepseek = PRESETS["DEEPSEEK_V3"]
    choice = registry.choose("route", "interpret", *shapes(8, deepseek), deepseek)
    assert choice.kernel and choice.run.keywords == {"interpret": True}
    assert choice.schedule.startswith("mosaic_route (w1s1c3u1; groups or softmax")
    for name, runs in (("DEEPSEEK_V3", "mosaic_route"), ("MIXTRAL_8X7B", "neither routing kernel")):
        cfg = dataclasses.replace(PRESETS[name], hidden=64)
        params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
        (route,) = [s for s in mf.explain((3, 64), params, backend="interpret").steps
                    if s.stage == "route"]
        assert route.kernel == (name == "DEEPSEEK_V3") and runs in route.why, route.why


@pytest.mark.parametrize("name, permute, kernels", [
    ("DEEPSEEK_V3", False, (1, 0)), ("DEEPSEEK_V3", True, (2, 0)),
    ("GLM_4_5", False, (1, 0)), ("GLM_4_5", True, (0, 1))])
def test_pallas_lowers_to_the_named_kernel_for_an_h200(name, permute, kernels):
    """(Mosaic GPU, Triton) kernels of ``"pallas"``: Mosaic's route (and its order, a second
    launch) or the Triton kernel alone, no routing left to XLA."""
    cfg = PRESETS[name]
    logits, bias = jnp.zeros((8, cfg.experts), jnp.float32), jnp.zeros((cfg.experts,), jnp.float32)
    text = lower_for_h200(lambda l, b: registry.run("route", "pallas", l, b, cfg, permute=permute),
                          logits, bias)
    assert (text.count("@mosaic_gpu_v2"), text.count("__gpu$xla.gpu.triton")) == kernels
    for op in ("stablehlo.sort", "top_k", "stablehlo.gather"):
        assert op not in text, op


@pytest.mark.parametrize("name", ["QWEN3_30B_A3B", "GLM_4_5"])
def test_interpret_route_equals_xla(name):
    """``mf.route`` on ``"interpret"`` (the Mosaic kernel for both) against ``"xla"``, bit for bit,
    on random rows with a NaN and ties at B = 3."""
    cfg = PRESETS[name]
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (3, cfg.experts)).astype(np.float32)
    logits[1, 5] = np.nan
    logits[2, :20] = 1.5
    bias = rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32) * cfg.bias
    choice = registry.choose("route", "interpret", *shapes(3, cfg), cfg)
    assert choice.kernel and choice.schedule.startswith(MOSAIC)
    route = jax.jit(mf.route, static_argnames=("cfg", "backend"))
    assert_each_bits_equal(route(logits, bias, cfg=cfg, backend="interpret"),
                           route(logits, bias, cfg=cfg, backend="xla"))


@pytest.mark.gpu
@pytest.mark.parametrize("name, permute, implementation, reason", RULE)
def test_gpu_stage_returns_the_named_kernels_bits(name, permute, implementation, reason):
    """On the GPU, ``"pallas"`` returns the bits of the kernel the rule names, called directly, on
    random and tied rows at B = 64."""
    del reason
    cfg = PRESETS[name]
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 2, (64, cfg.experts)).astype(np.float32)
    logits[0, :40] = 1.0
    logits = jnp.asarray(logits)
    bias = jnp.asarray(rng.uniform(-0.05, 0.05, cfg.experts), jnp.float32)
    direct = mr.route if implementation == MOSAIC else rk.route
    got = jax.jit(lambda l, b: mf.route(l, b, cfg, backend="pallas", permute=permute))(logits, bias)
    want = jax.jit(lambda l, b: direct(l, b, cfg, permute=permute))(logits, bias)
    assert_each_bits_equal(tuple(jax.tree.leaves(got)), tuple(jax.tree.leaves(want)))
