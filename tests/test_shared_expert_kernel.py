"""The Pallas shared expert (gate/up with situ in its epilogue, then down): interpret mode against the
reference and the float64 oracle, lowering for an H200 from the CPU host at the tp1 and tp8 shapes,
the schedules, and on a GPU against float64."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_front_jax as mf
import moe_front_jax.pallas.shared_expert as shared_stage
from moe_front_jax import registry, reference
from moe_front_jax.params import rank_slices
from moe_front_jax.pallas.shared_expert import kernel as se
from moe_front_jax.pallas.shared_expert import tma as st
from moe_front_jax.pallas.shared_expert import triton as stt
from moe_front_jax.pallas.gemm import mosaic, schedule
from moe_front_jax.pallas.gemm.schedule import GridConfig as Grid
from moe_front_jax.pallas.gemm.schedule import VectorConfig as Vec
from h200 import H200, lower_for_h200
from engine_cases import exact_rows
from kimi_k3 import k3_weights
import oracle

K3 = mf.KIMI_K3
SMALL_HIDDEN = 256
"""Interpret mode keeps K3's shared rows per rank and shrinks the hidden size."""


def exact_operands(batch, s_r, hidden, seed):
    """Small-integer x and gate_up rows scaled by powers of two from 2**-9 to 2**-2: every float32
    partial sum is exact, so gate and up (and their bfloat16 roundings) do not depend on the order of
    summation, while gate and up span the range where tanh and the sigmoid bend."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (batch, hidden)).astype(np.float32)
    w = exact_rows(rng, 2 * s_r, hidden, -9, -2)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("config",))
def gate_up_interpret(x, gate_up, *, config):
    return stt.gate_up_situ(x, gate_up, 4.0, 25.0, interpret=True, config=config)


# (batch, S_r, config): split-K and single-pass, B below / at / above 16, S_r a multiple of the tile
# (K3 at tp8: 768) and not (an S_r of 80 against 32-row tiles: the last tile runs past both blocks);
# the vector schedule at B = 1 and at its largest batch, 8, with a ragged last tile.
GATE_UP_CASES = [
    (1, 768, Grid(32, 64, 2, 4, 3)),
    (16, 768, Grid(64, 128, 1, 4, 2)),
    (37, 80, Grid(32, 64, 4, 4, 2)),
    (3, 80, Grid(16, 32, 1, 4, 2)),
    (1, 768, Vec(16, 64, 4)),
    (8, 80, Vec(32, 128, 2)),
]


@pytest.mark.parametrize("batch, s_r, config", GATE_UP_CASES)
def test_interpret_gate_up_situ_matches_reference_exactly(batch, s_r, config):
    x, w = exact_operands(batch, s_r, SMALL_HIDDEN, seed=batch)
    hidden = gate_up_interpret(x, w, config=config)
    assert hidden.dtype == jnp.bfloat16 and hidden.shape == (batch, s_r)
    h = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T  # exact: gate, up as the kernel sees
    gate, up = h[:, :s_r].astype(ml_dtypes.bfloat16), h[:, s_r:].astype(ml_dtypes.bfloat16)
    # The kernel's epilogue is reference.situ's float32 arithmetic on the same bfloat16 gate and up.
    want = reference.situ(jnp.asarray(gate), jnp.asarray(up), 4.0, 25.0)
    np.testing.assert_array_equal(np.asarray(hidden).view(np.uint16), np.asarray(want).view(np.uint16))
    # And within one bfloat16 ulp of the float64 oracle of situ (float32 vs float64 arithmetic).
    assert oracle.bf16_ulp_distance(hidden, oracle.situ(gate, up)).max() <= 1
    assert np.abs(np.asarray(hidden, np.float32)).max() > 1  # not a vacuous all-small output


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, rows, depth, config", [
    (5, 256, 768, Grid(32, 64, 3, 4, 2)),
    (20, 80, 96, Grid(32, 32, 1, 4, 2)),
    (5, 256, 768, Vec(8, 256, 4)),
    (2, 80, 96, Vec(32, 32, 4)),
])
def test_interpret_down_matches_float64_exactly(out_dtype, batch, rows, depth, config):
    """Small-integer hidden and down (rows scaled by powers of two): the float32 product is exact."""
    rng = np.random.default_rng(batch)
    h = jnp.asarray(rng.integers(-8, 9, (batch, depth)), jnp.bfloat16)
    d = rng.integers(-3, 4, (rows, depth)) * np.exp2(rng.integers(-6, 7, (rows, 1)))
    d = jnp.asarray(d, jnp.bfloat16)
    call = jax.jit(lambda h, d: stt.down_proj(h, d, out_dtype, interpret=True, config=config))
    got = call(h, d)
    want = (np.asarray(h, np.float64) @ np.asarray(d, np.float64).T).astype(np.float32)
    assert got.dtype == out_dtype and got.shape == (batch, rows)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(out_dtype).astype(np.float32))


def assert_close_to_float64(got, want, tol):
    """``|got - want| <= tol * max(|want|, the row's RMS)``: relative, with near-zero entries measured
    against their row's scale (float32 accumulation cannot give them a relative bound)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rms = np.sqrt((want**2).mean(axis=1, keepdims=True))
    err = np.abs(got - want) / np.maximum(np.abs(want), rms)
    assert err.max() <= tol, err.max()


@pytest.mark.parametrize("tp, batch, config, out_dtype", [
    (8, 37, se.SharedExpertConfig(Grid(64, 64, 2, 4, 2), Grid(64, 128, 2, 4, 2)), jnp.float32),
    (1, 3, se.SharedExpertConfig(Grid(128, 128, 1, 4, 2), Grid(64, 256, 2, 4, 2)), jnp.bfloat16),
    (8, 2, se.SharedExpertConfig(Vec(8, 128, 4), Vec(16, 32, 4)),
     jnp.float32),
])
def test_interpret_shared_expert_matches_reference_and_float64(tp, batch, config, out_dtype):
    """Both kernels split K at tp8 (the float32 partial moe_front reduces); bfloat16 out at tp1; both
    on the vector schedule at tp8."""
    cfg = dataclasses.replace(K3, hidden=SMALL_HIDDEN, tp=tp)
    weights = mf.init_weights(jax.random.key(tp), cfg)
    _, gate_up, down = rank_slices(weights, cfg, tp - 1, cfg.experts_per_rank)
    x = jax.random.normal(jax.random.key(batch), (batch, SMALL_HIDDEN)).astype(jnp.bfloat16)
    got = jax.jit(lambda x, g, d: se.shared_expert(
        x, g, d, cfg, out_dtype, interpret=True, config=config))(x, gate_up, down)
    assert got.dtype == out_dtype and got.shape == (batch, SMALL_HIDDEN)
    want = reference.shared_expert(x, gate_up, down, cfg, out_dtype)
    # Summation order moves gate/up by float32 ulps, which can flip a bfloat16 rounding of gate, up
    # or hidden: a few bfloat16 ulps at most, relative to the row.
    assert_close_to_float64(got, want, 2.0**-6)
    assert_close_to_float64(got, oracle.shared_expert(x, gate_up, down), 1e-2)


def route_any(logits, bias, cfg, *, interpret):
    """The routing reference in the kernels' signature, until the routing kernel is registered."""
    del interpret  # the reference has one mode
    return reference.route(logits, bias, cfg)


def test_moe_front_runs_the_kernel_under_interpret(monkeypatch, spy):
    """moe_front with shared-expert weights, past the merged front's 64 rows, calls the Pallas
    shared expert (interpret), once."""
    calls = spy("shared_expert", se, shared_stage)
    monkeypatch.setitem(registry.STAGES, "route", dataclasses.replace(
        registry.STAGES["route"], kernel="test_shared_expert_kernel:route_any"))
    registry.load.cache_clear()
    cfg = mf.FrontConfig(hidden=SMALL_HIDDEN, experts=128, top_k=16, latent=256, shared=96)
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
    x = jax.random.normal(jax.random.key(1), (65, SMALL_HIDDEN)).astype(jnp.bfloat16)
    try:
        got = jax.jit(lambda x, p: mf.moe_front(x, p, backend="interpret"))(x, params)
    finally:
        registry.load.cache_clear()
    assert calls == [{"interpret": True}]
    want = mf.moe_front(x, params, backend="xla")
    assert got.shared.dtype == jnp.bfloat16 and got.shared.shape == (65, SMALL_HIDDEN)
    assert_close_to_float64(got.shared, want.shared, 2.0**-6)


def test_registered_for_pallas_and_interpret(monkeypatch):
    stage = registry.STAGES["shared_expert"]
    assert stage.kernel == "moe_front_jax.pallas.shared_expert:shared_expert" and stage.interprets
    cfg = mf.FrontConfig(hidden=SMALL_HIDDEN, experts=128, top_k=16, latent=256, shared=96)
    args = (jax.ShapeDtypeStruct((5, SMALL_HIDDEN), jnp.bfloat16),
            jax.ShapeDtypeStruct((2 * 96, SMALL_HIDDEN), jnp.bfloat16),
            jax.ShapeDtypeStruct((SMALL_HIDDEN, 96), jnp.bfloat16), cfg)
    kernel = registry.choose("shared_expert", "interpret", *args)
    assert kernel.kernel and kernel.run.keywords == {"interpret": True}
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    kernel = registry.choose("shared_expert", "pallas", *args)
    assert kernel.kernel and kernel.run.keywords == {"interpret": False}


def kernel_count(text: str) -> int:
    """GPU kernels of a lowered call that are ours: Triton's and Mosaic GPU's custom calls."""
    return text.count("__gpu$xla.gpu.triton") + text.count("@mosaic_gpu_v2")


@pytest.mark.parametrize("tp", [1, 8])
def test_lowers_for_h200_as_two_kernels(tp):
    """Two kernels per call with the table's schedules (Triton's, or the TMA schedule's Mosaic GPU
    ones; plus zeroed counters where Triton splits K) and no XLA dot. Where both kernels finish
    their own tiles, no XLA cast or slice either: gate and up never leave the first kernel. (The
    TMA schedule hands XLA its float32 partials where it splits K, and the down's product where the
    output is float32; beside a Triton down, with no transpose: tp8 at B=64.)"""
    cfg = K3.with_tp(tp)
    s_r = cfg.shared_per_rank
    gate_up = jnp.zeros((2 * s_r, K3.hidden), jnp.bfloat16)
    down = jnp.zeros((K3.hidden, s_r), jnp.bfloat16)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    for batch in (1, 64, 256):
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        with jax.sharding.use_abstract_mesh(mesh):
            c = se.pick_config(s_r, K3.hidden, batch)
        for out_dtype in (jnp.float32, jnp.bfloat16):
            fn = functools.partial(se.shared_expert, cfg=cfg, out_dtype=out_dtype)
            text = lower_for_h200(fn, x, gate_up, down)
            assert kernel_count(text) == 2, (tp, batch)
            assert "stablehlo.dot_general" not in text, (tp, batch)
            gate_up_tma, down_tma = (isinstance(k, st.TmaConfig) for k in (c.gate_up, c.down))
            partials = ((gate_up_tma and c.gate_up.split_k > 1)
                        or (down_tma and (c.down.split_k > 1 or out_dtype == jnp.float32)))
            if not partials:
                for op in ("stablehlo.convert", "stablehlo.slice"):
                    assert op not in text, (tp, batch, op)
            if gate_up_tma and c.gate_up.split_k > 1 and not down_tma:
                # The Triton down reads hidden as the split TMA gate/up's partials lie.
                assert "stablehlo.transpose" not in text, (tp, batch)


@pytest.mark.parametrize("tp", [1, 8])
def test_vector_schedule_lowers_for_h200_as_two_kernels(tp):
    """The vector schedule: two Triton kernels and nothing else (no counters to zero)."""
    cfg = K3.with_tp(tp)
    s_r = cfg.shared_per_rank
    gate_up = jnp.zeros((2 * s_r, K3.hidden), jnp.bfloat16)
    down = jnp.zeros((K3.hidden, s_r), jnp.bfloat16)
    config = se.SharedExpertConfig(Vec(2, 512, 4), Vec(8, 256, 4))
    for batch in (1, 8):
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        fn = functools.partial(se.shared_expert, cfg=cfg, out_dtype=jnp.float32, config=config)
        text = lower_for_h200(fn, x, gate_up, down)
        assert text.count("__gpu$xla.gpu.triton") == 2, (tp, batch)
        for op in ("stablehlo.broadcast_in_dim", "stablehlo.convert", "stablehlo.dot_general"):
            assert op not in text, (tp, batch, op)


def test_table_entries_name_their_implementation():
    """Each kernel's config of a table entry names its implementation; the shared expert loads the
    Triton grid and vector schedules and the TMA one, and no other (no stream-K)."""
    grid = {"implementation": "triton_grid", "block_rows": 64, "block_k": 64, "split_k": 2,
            "num_warps": 4, "num_stages": 6}
    tma = {"implementation": "mosaic_tma", "block_rows": 64, "block_k": 128, "split_k": 1,
           "num_stages": 4, "batch_m": False}
    config = se.SharedExpertConfig.from_json({"gate_up": tma, "down": grid})
    assert config == se.SharedExpertConfig(st.TmaConfig(64, 128, 1, 4), Grid(64, 64, 2, 4, 6))
    assert config.implementation == "gate_up=mosaic_tma, down=triton_grid"
    stream_k = {"implementation": "triton_stream_k", "block_rows": 64, "block_k": 64,
                "num_warps": 4, "num_stages": 6, "programs": 132}
    with pytest.raises(ValueError, match="implementation must be one of"):
        se.SharedExpertConfig.from_json({"gate_up": tma, "down": stream_k})
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        for entry in se.tuning_entries(kind, "shared_expert").values():
            loaded = se.SharedExpertConfig.from_json(entry)
            assert {name: schedule.config_to_json(getattr(loaded, name)) for name in ("gate_up", "down")} == {
                name: entry[name] for name in ("gate_up", "down")}


def test_select_names_the_implementations_and_why():
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        tp8 = se.select(K3.with_tp(8).shared_per_rank, K3.hidden, 3)
        heuristic = se.select(64, 256, 3)
    assert tp8.implementation == "gate_up=mosaic_tma, down=triton_grid"
    assert tp8.reason == "NVIDIA H200 table, batch 4"
    assert heuristic.implementation == "gate_up=triton_grid, down=triton_grid"
    assert heuristic.reason.startswith("heuristic")
    assert heuristic.config == se.heuristic_config(64, 256, 3, H200.num_cores)


@pytest.mark.parametrize("hidden", [7168, 256])
@pytest.mark.parametrize("batch", [1, 37, 256])
def test_heuristic_config_divides_the_problem(hidden, batch):
    for tp in (1, 8, 16):
        s_r = K3.with_tp(tp).shared_per_rank
        c = se.heuristic_config(s_r, hidden, batch, cores=132)
        c.gate_up.check_divides(hidden, "H")
        c.down.check_divides(s_r, "S_r")
        bp = 1 << max(4, (batch - 1).bit_length())
        assert 2 * c.gate_up.num_stages * c.gate_up.block_k * (2 * c.gate_up.block_rows + bp) <= schedule.TRITON_PIPELINE_SMEM
        if hidden == 7168:  # room to split: every SM gets a gate/up program
            assert -(-s_r // c.gate_up.block_rows) * c.gate_up.split_k >= 132


def test_pick_config_uses_the_table_on_h200():
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    table = se.load_table(H200.device_kind)
    assert table, "pallas/tuning/h200_shared_expert.json is missing or empty (package data)"
    for tp in (1, 8):
        s_r = K3.with_tp(tp).shared_per_rank
        for batch in (1, 3, 8, 64):
            # The batch's own power of two where the table has it (tuned per small batch), else the
            # batch tile it pads to.
            own, padded = (se.table_key(s_r, K3.hidden, b) for b in (batch, max(16, batch)))
            key = own if own in table else padded
            assert key in table, key
            with jax.sharding.use_abstract_mesh(mesh):
                assert se.pick_config(s_r, K3.hidden, batch) == table[key]
            table[key].gate_up.check_divides(K3.hidden, "H")
            table[key].down.check_divides(s_r, "S_r")


TMA = functools.partial(st.TmaConfig, 64)
"""``TMA(block_k, split_k=, num_stages=)``: a TMA schedule (Mosaic GPU)."""
BATCH_M = functools.partial(st.TmaConfig, batch_m=True)
"""``BATCH_M(block_rows, block_k, split_k=, num_stages=)``: a TMA schedule with the batch as
wgmma's M."""


# (batch, S_r, config): B = 1, 8 (at most 8 rows: one TMA box), 13 (padded to 16 and sliced back),
# 24 (a multiple of 8), 64 (batch_m's whole M); two and three CTAs of 64 gate rows, and with the
# batch as M two to four of 24, 48 and 56; rings of 2 to 4 stages; K split 2 and 4 ways (XLA sums
# the partials and runs situ).
@pytest.mark.parametrize("batch, s_r, config", [
    (1, 128, TMA(64, split_k=1, num_stages=2)),
    (8, 192, TMA(128, split_k=1, num_stages=2)),
    (13, 128, TMA(64, split_k=1, num_stages=3)),
    (24, 128, TMA(64, split_k=1, num_stages=4)),
    (1, 128, TMA(64, split_k=2, num_stages=2)),
    (13, 64, TMA(32, split_k=4, num_stages=2)),
    (1, 96, BATCH_M(48, 64, split_k=1, num_stages=2)),
    (13, 112, BATCH_M(56, 128, split_k=1, num_stages=2)),
    (64, 144, BATCH_M(48, 64, split_k=1, num_stages=3)),
    (21, 96, BATCH_M(24, 32, split_k=2, num_stages=2)),
    (64, 48, BATCH_M(24, 64, split_k=4, num_stages=2)),
])
def test_interpret_tma_gate_up_situ_matches_reference_exactly(batch, s_r, config):
    """The TMA gate/up in Mosaic GPU's interpret mode: bit for bit reference.situ of the exact
    bfloat16 gate and up, as the Triton schedules."""
    x, w = exact_operands(batch, s_r, SMALL_HIDDEN, seed=batch)
    hidden = jax.jit(lambda x, w: st.gate_up_situ(x, w, 4.0, 25.0, interpret=True, config=config))(
        x, w)
    assert hidden.dtype == jnp.bfloat16 and hidden.shape == (batch, s_r)
    h = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    gate, up = h[:, :s_r].astype(ml_dtypes.bfloat16), h[:, s_r:].astype(ml_dtypes.bfloat16)
    want = reference.situ(jnp.asarray(gate), jnp.asarray(up), 4.0, 25.0)
    np.testing.assert_array_equal(np.asarray(hidden).view(np.uint16), np.asarray(want).view(np.uint16))
    assert np.abs(np.asarray(hidden, np.float32)).max() > 1


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, rows, depth, config", [
    (3, 128, 256, TMA(64, split_k=1, num_stages=2)),
    (16, 192, 128, TMA(128, split_k=1, num_stages=2)),
    (21, 64, 512, TMA(128, split_k=1, num_stages=3)),
    (9, 128, 512, TMA(64, split_k=4, num_stages=2)),
    (64, 112, 256, BATCH_M(56, 64, split_k=1, num_stages=2)),
    (5, 96, 512, BATCH_M(48, 128, split_k=2, num_stages=2)),
    (40, 64, 256, BATCH_M(32, 64, split_k=1, num_stages=3)),
])
def test_interpret_tma_down_matches_float64_exactly(out_dtype, batch, rows, depth, config):
    """The TMA down on small-integer operands, whose float32 product is exact: bfloat16 from the
    kernel's epilogue, float32 (a partial sum under tp) and split K through the partials."""
    rng = np.random.default_rng(batch)
    h = jnp.asarray(rng.integers(-8, 9, (batch, depth)), jnp.bfloat16)
    d = rng.integers(-3, 4, (rows, depth)) * np.exp2(rng.integers(-6, 7, (rows, 1)))
    d = jnp.asarray(d, jnp.bfloat16)
    got = jax.jit(lambda h, d: st.down_proj(h, d, out_dtype, interpret=True, config=config))(h, d)
    want = (np.asarray(h, np.float64) @ np.asarray(d, np.float64).T).astype(np.float32)
    assert got.dtype == out_dtype and got.shape == (batch, rows)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  want.astype(out_dtype).astype(np.float32))


@pytest.mark.parametrize("batch_m", [False, True])
@pytest.mark.parametrize("batch, split_k, out_dtype", [
    (1, 1, jnp.bfloat16), (37, 1, jnp.bfloat16), (3, 2, jnp.float32)])
def test_interpret_tma_shared_expert_matches_reference_and_float64(batch, split_k, out_dtype,
                                                                   batch_m):
    """Both kernels on the TMA schedule, one call, with the weight rows or (``batch_m``) the batch
    as wgmma's M: at tp1 (B=37 passes ``hidden`` between them in its 40 padded rows), and K split
    with a float32 partial sum, as at tp8."""
    cfg = dataclasses.replace(K3, hidden=SMALL_HIDDEN, shared=256)
    _, gate_up, down = rank_slices(mf.init_weights(jax.random.key(1), cfg), cfg, 0,
                                   cfg.experts_per_rank)
    x = jax.random.normal(jax.random.key(batch), (batch, SMALL_HIDDEN)).astype(jnp.bfloat16)
    config = (se.SharedExpertConfig(BATCH_M(32, 64, split_k=split_k, num_stages=2),
                                    BATCH_M(64, 128, split_k=split_k, num_stages=2)) if batch_m else
              se.SharedExpertConfig(TMA(64, split_k=split_k, num_stages=2),
                                    TMA(128, split_k=split_k, num_stages=2)))
    got = jax.jit(lambda x, g, d: se.shared_expert(x, g, d, cfg, out_dtype, interpret=True,
                                                   config=config))(x, gate_up, down)
    assert got.dtype == out_dtype and got.shape == (batch, SMALL_HIDDEN)
    assert_close_to_float64(got, reference.shared_expert(x, gate_up, down, cfg), 2.0**-6)
    assert_close_to_float64(got, oracle.shared_expert(x, gate_up, down), 1e-2)


# (batch, rows, depth, config): the down reading hidden transposed, [S_r, Bp] (Bp = B rounded up to
# 8), on the grid schedule (K whole and split), which pads it to its batch tile (a power of two >= 16): B = 3 (Bp = 8, tile 16), 13 (16, 16), 21 (24, 32), 8 (8, 16).
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, rows, depth, config", [
    (3, 128, 256, Grid(32, 64, 1, 4, 2)),
    (13, 96, 256, Grid(32, 64, 2, 4, 2)),
    (21, 64, 256, Grid(32, 64, 1, 4, 2)),
    (8, 64, 512, Grid(16, 128, 1, 4, 2)),
])
def test_interpret_down_from_transposed_hidden_matches_float64_exactly(out_dtype, batch, rows,
                                                                       depth, config):
    """``down_proj_t`` on ``hidden.T`` with zero columns past B: the exact product, as
    ``down_proj`` gives it from ``hidden``."""
    rng = np.random.default_rng(batch)
    h = rng.integers(-8, 9, (batch, depth))
    d = jnp.asarray(rng.integers(-3, 4, (rows, depth)) * np.exp2(rng.integers(-6, 7, (rows, 1))),
                    jnp.bfloat16)
    bp = -(-batch // 8) * 8
    h_t = jnp.asarray(np.pad(h, ((0, bp - batch), (0, 0))).T, jnp.bfloat16)
    got = jax.jit(lambda h_t, d: stt.down_proj_t(h_t, d, batch, out_dtype, interpret=True,
                                                 config=config))(h_t, d)
    want = (h.astype(np.float64) @ np.asarray(d, np.float64).T).astype(np.float32)
    assert got.dtype == out_dtype and got.shape == (batch, rows)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  want.astype(out_dtype).astype(np.float32))
    plain = stt.down_proj(jnp.asarray(h, jnp.bfloat16), d, out_dtype, interpret=True, config=config)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain, np.float32))


@pytest.mark.parametrize("batch_m", [False, True])
@pytest.mark.parametrize("batch", [3, 13, 21])
def test_interpret_tma_split_gate_up_hands_the_down_hidden_transposed(batch, batch_m):
    """The TMA gate/up with K split beside a Triton down (tp8's table): ``gate_up_situ_t`` is
    ``gate_up_situ`` transposed, with zero columns to Bp, and ``shared_expert`` (through it, or
    with ``batch_m``, whose partials lie batch-major, through ``hidden`` itself) gives the two
    public kernels' result bit for bit."""
    cfg = dataclasses.replace(K3, hidden=SMALL_HIDDEN, shared=256)
    _, gate_up, down = rank_slices(mf.init_weights(jax.random.key(1), cfg), cfg, 0,
                                   cfg.experts_per_rank)
    x = jax.random.normal(jax.random.key(batch), (batch, SMALL_HIDDEN)).astype(jnp.bfloat16)
    gate_up_config = (BATCH_M(32, 64, split_k=2, num_stages=2) if batch_m else
                      TMA(64, split_k=2, num_stages=2))
    config = se.SharedExpertConfig(gate_up_config, Grid(64, 64, 1, 4, 2))
    h_t = st.gate_up_situ_t(x, gate_up, cfg.situ_beta, cfg.linear_beta, config=config.gate_up,
                            interpret=True)
    h = st.gate_up_situ(x, gate_up, cfg.situ_beta, cfg.linear_beta, interpret=True,
                        config=config.gate_up)
    bp = -(-batch // 8) * 8
    assert h_t.shape == (cfg.shared, bp) and h_t.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(h_t[:, :batch].T, np.float32), np.asarray(h, np.float32))
    assert not np.asarray(h_t[:, batch:], np.float32).any()
    got = se.shared_expert(x, gate_up, down, cfg, jnp.float32, interpret=True, config=config)
    want = stt.down_proj(h, down, jnp.float32, interpret=True, config=config.down)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_close_to_float64(got, oracle.shared_expert(x, gate_up, down), 1e-2)


def test_tma_schedule_lowers_for_h200_as_two_mosaic_kernels():
    """At K3's tp1 shapes (64-row CTAs, and the H100 table's B=64 schedule with the batch as M: 128
    CTAs of 48 gate and 128 of 56 down rows): two Mosaic GPU kernels and no XLA dot; at B=37, not a
    multiple of 8, one pad of ``x`` and one slice of the output beside them. At tp8's, K split 14
    (or 8) ways and the float32 partial sum: the same two kernels, XLA summing their partials (no
    dot either) and rounding gate and up with ``reduce_precision``
    (``reference.round_to_bfloat16``)."""
    for tp, config, out_dtype in (
        (1, se.SharedExpertConfig(TMA(128, split_k=1, num_stages=4),
                                  TMA(128, split_k=1, num_stages=6)), jnp.bfloat16),  # tp1 B=64's
        (1, se.SharedExpertConfig(BATCH_M(48, 128, split_k=1, num_stages=4),
                                  BATCH_M(56, 128, split_k=1, num_stages=6)), jnp.bfloat16),
        (8, se.SharedExpertConfig(TMA(64, split_k=14, num_stages=4),
                                  TMA(64, split_k=1, num_stages=6)), jnp.float32),
        (8, se.SharedExpertConfig(BATCH_M(48, 128, split_k=8, num_stages=4),
                                  BATCH_M(56, 128, split_k=1, num_stages=6)), jnp.float32),
    ):
        s_r = K3.with_tp(tp).shared_per_rank
        gate_up = jnp.zeros((2 * s_r, K3.hidden), jnp.bfloat16)
        down = jnp.zeros((K3.hidden, s_r), jnp.bfloat16)
        for batch in (1, 8, 37, 64):
            x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
            fn = functools.partial(se.shared_expert, cfg=K3.with_tp(tp), out_dtype=out_dtype,
                                   config=config)
            text = lower_for_h200(fn, x, gate_up, down)
            assert text.count("@mosaic_gpu_v2") == 2 and "triton" not in text, (tp, batch)
            assert "stablehlo.dot_general" not in text, (tp, batch)
            # XLA's split-K epilogue rounds gate and up where no fusion can drop it (tp8 only).
            assert text.count("stablehlo.reduce_precision") == (2 if tp == 8 else 0), (tp, batch)
            if tp == 1:
                assert (text.count("stablehlo.pad"), text.count("stablehlo.slice")) == (
                    (1, 1) if batch == 37 else (0, 0)), batch


@pytest.mark.parametrize("launch_with_pdl", [True, False])
def test_tma_kernels_launch_with_pdl(monkeypatch, launch_with_pdl):
    """Each TMA kernel (tp1's two; tp8's split gate/up and down) starts with griddepcontrol.wait,
    so Mosaic GPU marks its module for programmatic dependent launch; with
    ``LAUNCH_WITH_PDL`` off, none does."""
    monkeypatch.setattr(mosaic, "LAUNCH_WITH_PDL", launch_with_pdl)
    for tp, out_dtype in ((1, jnp.bfloat16), (8, jnp.float32)):
        cfg = K3.with_tp(tp)
        split = 1 if tp == 1 else 8
        config = se.SharedExpertConfig(TMA(128, split_k=split, num_stages=4),
                                       TMA(128, split_k=1, num_stages=4))
        s_r = cfg.shared_per_rank
        x = jnp.zeros((8, K3.hidden), jnp.bfloat16)
        gate_up = jnp.zeros((2 * s_r, K3.hidden), jnp.bfloat16)
        down = jnp.zeros((K3.hidden, s_r), jnp.bfloat16)
        text = lower_for_h200(functools.partial(se.shared_expert, cfg=cfg, out_dtype=out_dtype,
                                                config=config), x, gate_up, down)
        assert text.count("@mosaic_gpu_v2") == 2, tp
        assert text.count("mosaic_gpu.uses_pdl") == (2 if launch_with_pdl else 0), tp
        assert text.count("griddepcontrol.wait") == (2 if launch_with_pdl else 0), tp


def test_tma_config_and_request_errors():
    """A TMA schedule is 64 rows (with ``batch_m``: a multiple of 8 up to 256) and two stages or
    more; a request it does not cover is a NotImplementedError that says so."""
    with pytest.raises(ValueError, match="TmaConfig.block_rows must be 64"):
        st.TmaConfig(128, 128, 1, 4)
    with pytest.raises(ValueError, match="TmaConfig.num_stages must be an int >= 2, got 1"):
        st.TmaConfig(64, 128, 1, 1)
    with pytest.raises(ValueError, match="TmaConfig.batch_m must be a bool, got 1"):
        st.TmaConfig(48, 128, 1, 4, batch_m=1)
    for rows in (20, 0, 264):
        with pytest.raises(ValueError, match=f"block_rows with batch_m .* got {rows}"):
            st.TmaConfig(rows, 128, 1, 4, batch_m=True)
    assert st.TmaConfig(256, 128, 1, 2, batch_m=True).block_rows == 256
    with pytest.raises(ValueError, match="config must be a TmaConfig"):
        st.down_proj(jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((64, 128), jnp.bfloat16),
                     config=Grid(64, 64, 1, 4, 2))
    with pytest.raises(ValueError, match="config must be a GridConfig or VectorConfig"):
        stt.down_proj(jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((64, 128), jnp.bfloat16),
                      config=TMA(64, split_k=1, num_stages=2))
    x, h = jnp.zeros((65, 256), jnp.bfloat16), jnp.zeros((2, 128), jnp.bfloat16)
    two_stages = TMA(64, split_k=1, num_stages=2)
    with pytest.raises(NotImplementedError, match="covers B <= 64, got B=65"):
        st.gate_up_situ(x, jnp.zeros((256, 256), jnp.bfloat16), 4.0, 25.0, config=two_stages)
    with pytest.raises(NotImplementedError, match="rows a multiple of block_rows=64, got 96"):
        st.gate_up_situ(x[:2], jnp.zeros((192, 256), jnp.bfloat16), 4.0, 25.0, config=two_stages)
    with pytest.raises(ValueError, match="needs K divisible by split_k \\* block_k = 256"):
        st.down_proj(h, jnp.zeros((64, 128), jnp.bfloat16), config=TMA(128, split_k=2,
                                                                        num_stages=2))


def test_errors():
    cfg = dataclasses.replace(K3, hidden=64, shared=64)
    x = jnp.zeros((2, 64), jnp.bfloat16)
    gu, d = jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="x must be a 2-D bfloat16 array"):
        se.shared_expert(x.astype(jnp.float32), gu, d, cfg)
    with pytest.raises(ValueError, match=r"gate_up must be \[2 S_r, H=64\]"):
        se.shared_expert(x, gu[:, :32], d, cfg)
    with pytest.raises(ValueError, match=r"down must be \[H, S_r\] = \(64, 64\)"):
        se.shared_expert(x, gu, d[:, :32], cfg)
    with pytest.raises(ValueError, match="out_dtype must be bfloat16 or float32"):
        se.shared_expert(x, gu, d, cfg, jnp.float16)
    with pytest.raises(ValueError, match="x is an empty batch"):
        se.shared_expert(x[:0], gu, d, cfg)
    with pytest.raises(ValueError, match="needs K divisible by split_k"):
        se.shared_expert(x, gu, d, cfg, config=se.SharedExpertConfig(Grid(32, 64, 2, 4, 2), Grid(32, 16, 1, 4, 2)))
    with pytest.raises(ValueError, match="must be a SharedExpertConfig"):
        se.shared_expert(x, gu, d, cfg, config=Grid(32, 16, 1, 4, 2))
    with pytest.raises(NotImplementedError, match="B <= 256 .* backend='xla'"):
        se.shared_expert(jnp.zeros((257, 64), jnp.bfloat16), gu, d, cfg)
    with pytest.raises(NotImplementedError, match="multiples of 16"):
        se.shared_expert(x[:, :40], gu[:, :40], d[:40], cfg)
    vector = se.SharedExpertConfig(Vec(4, 64, 4), Vec(4, 64, 4))
    with pytest.raises(ValueError, match="covers B <= 8, got B=9"):
        se.shared_expert(jnp.zeros((9, 64), jnp.bfloat16), gu, d, cfg, config=vector)


# --- on the GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_matches_float64(tp):
    """At K3's shapes, the kernels' output (float32 partial and bfloat16) within 1e-2 of the float64
    oracle (relative to each value, measured at least at its row's RMS), on the last rank's slice,
    with the tuned schedules of every tuned batch but 2 and 4 (tensor-core ones from B = 2 on). At
    tp8 B = 7, 16, 37 and 64 the down reads ``hidden.T``, padded to its batch tile at B = 7 and
    37."""
    cfg = K3.with_tp(tp)
    _, gate_up, down = rank_slices(k3_weights(), cfg, tp - 1, cfg.experts_per_rank)
    for batch in (1, 7, 16, 37, 64):
        x = jax.random.normal(jax.random.key(batch), (batch, K3.hidden)).astype(jnp.bfloat16)
        want = oracle.shared_expert(x, gate_up, down)
        for out_dtype in (jnp.float32, jnp.bfloat16):
            got = jax.jit(lambda x, g, d: se.shared_expert(x, g, d, cfg, out_dtype))(x, gate_up, down)
            assert got.dtype == out_dtype and got.shape == (batch, K3.hidden)
            assert_close_to_float64(got, want, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_vector_schedule_matches_float64(tp):
    """The vector schedule at the batches it covers, to the same bound."""
    cfg = K3.with_tp(tp)
    _, gate_up, down = rank_slices(k3_weights(), cfg, tp - 1, cfg.experts_per_rank)
    config = se.SharedExpertConfig(Vec(2, 512, 4), Vec(8, 256, 4))
    for batch in (1, 2, 8):
        x = jax.random.normal(jax.random.key(batch), (batch, K3.hidden)).astype(jnp.bfloat16)
        want = oracle.shared_expert(x, gate_up, down)
        got = jax.jit(lambda x, g, d: se.shared_expert(x, g, d, cfg, jnp.float32, config=config))(
            x, gate_up, down)
        assert got.dtype == jnp.float32 and got.shape == (batch, K3.hidden)
        assert_close_to_float64(got, want, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_m", [False, True])
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_tma_schedule_matches_float64(tp, batch_m):
    """The TMA schedule (tp1: bfloat16 out; tp8: K split, the float32 partial), with the weight
    rows or (``batch_m``) the batch as wgmma's M, at batches below, between and at its multiples of
    8 and its largest, to the same bound."""
    cfg = K3.with_tp(tp)
    _, gate_up, down = rank_slices(k3_weights(), cfg, tp - 1, cfg.experts_per_rank)
    out_dtype = jnp.bfloat16 if tp == 1 else jnp.float32
    config = {
        (1, False): se.SharedExpertConfig(TMA(128, split_k=1, num_stages=4),
                                          TMA(128, split_k=1, num_stages=6)),
        (8, False): se.SharedExpertConfig(TMA(64, split_k=14, num_stages=4),
                                          TMA(128, split_k=1, num_stages=3)),
        (1, True): se.SharedExpertConfig(BATCH_M(48, 128, split_k=1, num_stages=4),
                                         BATCH_M(56, 128, split_k=1, num_stages=5)),
        (8, True): se.SharedExpertConfig(BATCH_M(48, 128, split_k=8, num_stages=4),
                                         BATCH_M(56, 128, split_k=1, num_stages=5)),
    }[tp, batch_m]
    for batch in (1, 7, 16, 37, 64):
        x = jax.random.normal(jax.random.key(batch), (batch, K3.hidden)).astype(jnp.bfloat16)
        want = oracle.shared_expert(x, gate_up, down)
        got = jax.jit(lambda x, g, d: se.shared_expert(x, g, d, cfg, out_dtype, config=config))(
            x, gate_up, down)
        assert got.dtype == out_dtype and got.shape == (batch, K3.hidden)
        assert_close_to_float64(got, want, 1e-2)
