"""The layer kernel (``moe_front_jax.pallas.engine.layer``): the tile queues in Python (every tile
once, the front's before the down's in each queue), interpret mode (the same queues as two
launches) against the engine's two launches and exact float64 products, ``covers``' errors,
lowering for an H200 (one launch with its semaphore), and on a GPU against the engine's two launches
bit for bit, many launches in a row."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.pallas.engine import kernel as ek
from moe_front_jax.pallas.engine import layer as el
from moe_front_jax.pallas.engine.kernel import EngineConfig
from bitwise import bits, plan_bytes
from engine_cases import (HIDDEN, K3, S_R, SMALL, SPLIT, VALID, assert_front_exact,
                          close_to_float64, exact_front, exact_gate_up, exact_rows, k3_arrays,
                          product, situ_of)
from h200 import lower_for_h200
from kimi_k3 import k3_weights

# --- the queues ------------------------------------------------------------------------------------


def k3_queues(tp: int) -> el.Queues:
    cfg = K3.with_tp(tp)
    valid, shard, s_r = cfg.experts_per_rank, cfg.latent_per_rank, cfg.shared_per_rank
    front = ek.heuristic_config(K3.hidden, router=valid, latent=shard, gate_up=s_r,
                                plan_block=cfg.plan_block)
    down = ek.heuristic_config(s_r, down=K3.hidden)
    regions, _ = ek._front_parts(valid, valid, shard, 8, cfg.plan_block, front)
    gate = ek.Region(ek.GATE_UP, 1, (0, s_r), s_r, front.gate_up_rows, (5,))
    shared = ek.Region(ek.DOWN, 2, (0,), K3.hidden, down.down_rows, (4,))
    return el.queues((*regions, gate), shared, front, down, K3.hidden, s_r, 132)


def check_table(table: np.ndarray, total: int, ctas: int) -> None:
    """``ctas`` queues; every one of ``total`` tiles in exactly one; each queue in tile order, so a
    CTA's front tiles come before its first down tile (it never waits before it has signalled),
    and ``NO_TILE`` only after its last tile."""
    assert table.shape[0] == ctas
    assert sorted(table[table != el.NO_TILE].tolist()) == list(range(total))
    for row in table:
        mine = row[row != el.NO_TILE]
        assert (np.diff(mine) > 0).all()
        assert (row[len(mine):] == el.NO_TILE).all()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_k3_queues(tp):
    """At K3's shapes every SM gets a queue, the down's tiles last; each CTA runs at most one down
    tile, and with its front tiles at most three tiles."""
    q = k3_queues(tp)
    check_table(q.table, sum(r.ctas for r in q.regions), 132)
    assert q.regions[-1].kind == ek.DOWN
    assert (np.sum(q.table >= q.starts[-1], axis=1) <= 1).all()
    assert q.table.shape[1] <= 3


@pytest.mark.parametrize("seed", range(20))
def test_schedule_of_random_regions(seed):
    """List scheduling over random region mixes and grids: every tile once, each queue in order,
    and every CTA some tile where there are as many tiles as CTAs (a down tile goes to an idle CTA
    before a busy one)."""
    rng = np.random.default_rng(seed)
    times = [(int(rng.integers(1, 40)), float(rng.uniform(0.5, 3))) for _ in range(rng.integers(1, 4))]
    times.append((int(rng.integers(1, 60)), float(rng.uniform(0.2, 2))))
    ctas = int(rng.integers(1, 50))
    table = el.schedule(times, len(times) - 1, ctas)
    total = sum(c for c, _ in times)
    check_table(table, total, ctas)
    if total >= ctas:
        assert (table != el.NO_TILE).any(axis=1).all()


# --- interpret mode ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("plan", "out_dtype", "front", "down_config"))
def layer_interpret(x, w, gate_up, down, *, plan=False, out_dtype=jnp.bfloat16, front=None,
                    down_config=None):
    return el.layer(x, w, SPLIT, VALID, gate_up, down, SMALL, plan=plan, out_dtype=out_dtype,
                    front_config=front, down_config=down_config, interpret=True)


@functools.partial(jax.jit, static_argnames=("plan", "out_dtype", "front", "down_config"))
def engine_interpret(x, w, gate_up, down, *, plan=False, out_dtype=jnp.bfloat16, front=None,
                     down_config=None):
    logits, latent, planned, hidden = ek.front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL,
                                                       plan=plan, config=front, interpret=True)
    return logits, latent, planned, ek.down(hidden, down, out_dtype, config=down_config,
                                            interpret=True)


LAYER_CONFIGS = (
    (None, None),
    (EngineConfig(router_rows=16, latent_rows=64, gate_up_rows=16, block_k=64, num_stages=3,
                  fold_k=128),
     EngineConfig(down_rows=64, block_k=32, num_stages=2)),
)


@pytest.mark.parametrize("configs", LAYER_CONFIGS)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("batch", (1, 3, 37, 64))
def test_interpret_layer_is_exact(batch, out_dtype, configs):
    """Exact data: logits and latent exact, the plan the reference's, and the shared expert's
    output bit-equal to the engine's two launches (the same tiles), which equals the float64
    down of the reference situ's ``hidden`` rounded once."""
    front, down_config = configs
    x, w = exact_front(batch, seed=batch)
    gate_up = exact_gate_up(S_R, seed=batch + 1)
    down = jnp.asarray(exact_rows(np.random.default_rng(batch), HIDDEN, S_R, -12, -6), jnp.bfloat16)
    got = layer_interpret(x, w, gate_up, down, plan=True, out_dtype=out_dtype, front=front,
                          down_config=down_config)
    logits, latent, planned, shared = got
    assert shared.shape == (batch, HIDDEN) and shared.dtype == out_dtype
    assert_front_exact(logits, latent, product(x, w))
    for one, ref in zip(plan_bytes(planned), plan_bytes(reference.mxfp8_plan(latent))):
        np.testing.assert_array_equal(one, ref)
    want = engine_interpret(x, w, gate_up, down, plan=True, out_dtype=out_dtype, front=front,
                            down_config=down_config)
    np.testing.assert_array_equal(bits(shared), bits(want[3]))
    y = product(situ_of(product(x, gate_up), S_R), down)
    assert close_to_float64(shared, y, 1e-2 if out_dtype == jnp.bfloat16 else 1e-5)
    assert np.abs(np.asarray(shared, np.float32)).max() > 0  # not a vacuous all-zero output


def test_interpret_layer_without_plan():
    x, w = exact_front(8, seed=4)
    gate_up = exact_gate_up(S_R, seed=5)
    down = jnp.asarray(exact_rows(np.random.default_rng(6), HIDDEN, S_R, -12, -6), jnp.bfloat16)
    logits, latent, planned, shared = layer_interpret(x, w, gate_up, down)
    assert planned is None
    want = engine_interpret(x, w, gate_up, down)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want[0]))
    np.testing.assert_array_equal(bits(latent), bits(want[1]))
    np.testing.assert_array_equal(bits(shared), bits(want[3]))


def test_covers_errors():
    x, w = exact_front(8)
    gate_up = exact_gate_up(S_R)
    down = jnp.zeros((HIDDEN, S_R), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"down must be \[H, S_r\] = \[256, 64\].*\(64, 256\)"):
        el.covers_layer(x, w, SPLIT, VALID, gate_up, down.T, SMALL)
    with pytest.raises(NotImplementedError, match="B <= 64"):
        el.covers_layer(jnp.zeros((65, HIDDEN), jnp.bfloat16), w, SPLIT, VALID, gate_up, down,
                        SMALL)
    with pytest.raises(ValueError, match="out_dtype"):
        el.covers_layer(x, w, SPLIT, VALID, gate_up, down, SMALL, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"need 0 < valid <= split <= rows of packed.*split=81"):
        el.covers_layer(x, w[:SPLIT], SPLIT + 1, VALID, gate_up, down, SMALL)


# --- lowering -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("batch", [1, 37, 64])
def test_lowers_for_h200_as_one_launch(tp, batch):
    """K3's layer lowers for an H200 as one Mosaic GPU kernel launched with PDL, no XLA dot beside
    it; the semaphore is the kernel's one global scratch, which XLA zero-fills."""
    cfg, valid, split, x, packed, gate_up, _, down = k3_arrays(tp, batch)
    out_dtype = jnp.float32 if tp > 1 else jnp.bfloat16
    text = lower_for_h200(
        lambda x, w, g, d: el.layer(x, w, split, valid, g, d, cfg, plan=True,
                                    out_dtype=out_dtype), x, packed, gate_up, down)
    assert text.count("@mosaic_gpu_v2") == 1 and "triton" not in text
    assert "stablehlo.dot_general" not in text
    assert text.count("mosaic_gpu.uses_pdl") == 1
    assert "tensor<1xi32>" in text  # the semaphore's zero-filled global


@pytest.mark.parametrize("tp", [1, 8])
def test_lowers_for_h200_without_a_latent(tp):
    """DeepSeek-V3's rank (256 router rows, no latent, the SiLU gate over 2048 / tp shared rows)
    lowers for an H200 as one launch too."""
    cfg = mf.configs.DEEPSEEK_V3.with_tp(tp)
    valid, s_r, hidden = cfg.experts_per_rank, cfg.shared_per_rank, cfg.hidden
    x = jnp.zeros((8, hidden), jnp.bfloat16)
    packed = jnp.zeros((valid, hidden), jnp.bfloat16)
    gate_up, down = jnp.zeros((2 * s_r, hidden), jnp.bfloat16), jnp.zeros((hidden, s_r), jnp.bfloat16)
    text = lower_for_h200(
        lambda x, w, g, d: el.layer(x, w, valid, valid, g, d, cfg, out_dtype=jnp.float32),
        x, packed, gate_up, down)
    assert text.count("@mosaic_gpu_v2") == 1 and "stablehlo.dot_general" not in text


# --- on a GPU ------------------------------------------------------------------------------------------


def _one_and_two(tp: int):
    """K3's params at ``tp``, the layer kernel (as it is, then jitted) and the engine's two launches
    (jitted; the same tiles), each ``(x, packed, gate_up, down) -> (logits, latent, plan,
    shared)``."""
    cfg = K3.with_tp(tp)
    params = mf.pack_params(k3_weights(), cfg)
    valid, split = cfg.experts_per_rank, params.split
    out_dtype = jnp.float32 if tp > 1 else jnp.bfloat16

    def two_launches(x, w, g, d):
        logits, latent, planned, hidden = ek.front_gate_up(x, w, split, valid, g, cfg, plan=True)
        return logits, latent, planned, ek.down(hidden, d, out_dtype)

    def one_launch(x, w, g, d):
        return el.layer(x, w, split, valid, g, d, cfg, plan=True, out_dtype=out_dtype)

    return params, one_launch, jax.jit(one_launch), jax.jit(two_launches)


def _flat(outputs):
    logits, latent, planned, shared = outputs
    return [np.asarray(logits), bits(latent), *plan_bytes(planned), bits(shared)]


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_layer_matches_the_engine_and_float64(tp):
    """One launch gives the engine's two launches' bits (the same tiles in the same order: a missed
    hand-off would read a stale ``hidden``); the logits within 1e-5 of float64, the latent within
    one ulp."""
    params, _, one, two = _one_and_two(tp)
    valid, split = K3.with_tp(tp).experts_per_rank, params.split
    for batch in (1, 7, 37, 64):
        x = jax.random.normal(jax.random.key(batch), (batch, K3.hidden)).astype(jnp.bfloat16)
        args = (x, params.packed, params.gate_up, params.down)
        got, want = one(*args), two(*args)
        for a, b in zip(_flat(got), _flat(want)):
            np.testing.assert_array_equal(a, b)
        y = product(x, params.packed)
        assert close_to_float64(got[0], y[:, :valid], 1e-5), (tp, batch)
        err = np.abs(np.asarray(got[1].astype(jnp.float32), np.float64) - y[:, split:])
        mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))[:, split:]
        assert (err <= ml_dtypes.finfo(ml_dtypes.bfloat16).eps * mag).all(), (tp, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_layer_many_launches_in_a_row(tp):
    """Forty launches dispatched back to back, and a program of eight layers chained, each on
    other inputs, each checked against the engine's two launches: a counter left from the launch
    before, or a down tile that does not wait, shows as a wrong ``shared``."""
    params, layer, one, two = _one_and_two(tp)
    weights = (params.packed, params.gate_up, params.down)
    xs = [jax.random.normal(jax.random.key(100 + i), (8, K3.hidden)).astype(jnp.bfloat16)
          for i in range(40)]
    got = [one(x, *weights) for x in xs]  # no wait between the launches
    for i, x in enumerate(xs):
        for a, b in zip(_flat(got[i]), _flat(two(x, *weights))):
            np.testing.assert_array_equal(a, b, err_msg=f"launch {i}")

    def chain(x, *w):
        steps = []
        for _ in range(8):
            out = layer(x, *w)
            steps.append((x, out))
            x = (x.astype(jnp.float32) + out[3].astype(jnp.float32)).astype(x.dtype)
        return steps

    # Each layer against the engine's two launches on the x that layer was given.
    for i, (x, out) in enumerate(jax.jit(chain)(xs[0], *weights)):
        for a, b in zip(_flat(out), _flat(two(x, *weights))):
            np.testing.assert_array_equal(a, b, err_msg=f"chained layer {i}")


@pytest.mark.parametrize("activation", ["situ", "silu"])
@pytest.mark.parametrize("batch", (1, 37))
def test_interpret_layer_without_a_latent(batch, activation):
    """A front without a latent (``latent = 0``: DeepSeek-V3, Kimi-K2, GLM-4.5), with either
    activation: the router rows alone beside the shared expert. The logits exact, a latent of no
    columns, and the shared expert's output the reference's within SPEC section 6's bound."""
    cfg = dataclasses.replace(SMALL, latent=0, activation=activation)
    x, w = exact_front(batch, seed=batch)
    packed = w[:SPLIT]
    gate_up = exact_gate_up(S_R, seed=batch + 1)
    down = jnp.asarray(exact_rows(np.random.default_rng(batch), HIDDEN, S_R, -12, -6), jnp.bfloat16)
    logits, latent, planned, shared = jax.jit(
        lambda *a: el.layer(*a[:2], SPLIT, VALID, *a[2:], cfg, interpret=True))(
            x, packed, gate_up, down)
    np.testing.assert_array_equal(np.asarray(logits), product(x, w)[:, :VALID].astype(np.float32))
    assert latent.shape == (batch, 0) and planned is None
    want = reference.shared_expert(x, gate_up, down, cfg)
    assert close_to_float64(shared, np.asarray(want, np.float64), 1e-2)
    hidden = reference.shared_hidden(x, gate_up, cfg)
    np.testing.assert_array_equal(
        bits(shared), bits(ek.down(hidden, down, interpret=True)))
    with pytest.raises(ValueError, match="plan=True needs latent rows"):
        el.layer(x, packed, SPLIT, VALID, gate_up, down, cfg, plan=True, interpret=True)
