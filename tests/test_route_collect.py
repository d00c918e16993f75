"""The routing kernel that polls the mailbox (``pallas/route_collect.py``): interpret mode against the
plain-JAX collect followed by the reference routing, through ``moe_front`` against the direct path,
timeouts, lowering for an H200, and on a GPU against the jax-triton collect and the routing kernel.

Expected values come from the plain-JAX protocol (``mailbox.collect`` with ``backend="xla"``), the
reference routing and the direct path, never from the kernel under test."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import mailbox as mb
from moe_front_jax import reference
from moe_front_jax.pallas.plan import kernel as pallas_plan
from moe_front_jax.pallas.route import kernel as rt
from moe_front_jax.pallas.route_collect import kernel as rc
from bitwise import assert_bits_equal
from h200 import lower_for_h200
from mailbox_cases import (
    SENTINEL,
    SMALL,
    assert_armed,
    assert_equals_direct,
    canonical_latent,
    canonical_logits,
    rows_of,
    shards_with_negative_zeros,
    weights_of,
)
import oracle
from plan_cases import edge_latent

WIDE = mf.FrontConfig(hidden=64, experts=1024, top_k=32, latent=40, shared=0, plan_block=2)


def bias_of(cfg, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32))


def on_mailbox(box, status, bias, batch, **kwargs):
    """``rc.route_collect`` over the mailbox's arrays; returns its outputs with the buffer and control
    put back into the mailbox: ``(ids, weights, logits, latent, [plan,] status, mailbox)``."""
    *out, buffer, control = rc.route_collect(box.buffer, box.control, status, bias, batch, box.cfg,
                                             **kwargs)
    return (*out, dataclasses.replace(box, buffer=buffer, control=control))


def interpret(box, bias, batch, spin_limit=rc.ROUTE_COLLECT_SPIN_LIMIT, with_plan=False,
              config=None):
    return jax.jit(
        lambda box, status, bias: on_mailbox(
            box, status, bias, batch, interpret=True, spin_limit=spin_limit, with_plan=with_plan,
            config=config,
        )
    )(box, jnp.zeros((), jnp.int32), bias)


def expected(box, bias, batch):
    logits, latent, status, box = mb.collect(box, batch, backend="xla")
    ids, weights = jax.jit(reference.route, static_argnums=2)(logits, bias, box.cfg)
    return ids, weights, logits, latent, status, box


@pytest.mark.parametrize("select", ["groups", "argmax"])
@pytest.mark.parametrize(
    "cfg, batches", [(SMALL, (1, 3, 8)), (mf.KIMI_K3, (1, 3)), (WIDE, (2,))], ids=["small", "k3", "wide"]
)
def test_interpret_equals_collect_then_route(cfg, batches, select):
    """Over consecutive steps (generations rotating), rows of -0, subnormals and random values: the
    same ids, weights, logits and latent bits, status 0, the mailbox left as the plain collect leaves
    it (armed, control words updated); with the plan (every other step), the reference plan of the
    collected latent."""
    box = mf.Mailbox.create(cfg, capacity=8)
    bias = bias_of(cfg, 0)
    for t, batch in enumerate(batches):
        shards = shards_with_negative_zeros(cfg, batch, seed=t)
        box = mb.publish(box, *shards, backend="xla")
        want = expected(box, bias, batch)
        with_plan = t % 2 == 0
        config = rt.RouteConfig(2, 4, select)  # two rows a program: row masks at odd batches
        *got, box = interpret(box, bias, batch, with_plan=with_plan, config=config)
        if with_plan:
            values, scales = got.pop(4)
            plan = reference.mxfp8_plan(jnp.asarray(canonical_latent(shards[1])), cfg.plan_block)
            assert_bits_equal(values, plan[0])
            assert_bits_equal(scales, plan[1])
        for g, w in zip(got, want):
            assert_bits_equal(g, w)
        assert_bits_equal(got[2], canonical_logits(shards[0]))
        assert_bits_equal(got[3], canonical_latent(shards[1]))
        assert int(got[4]) == 0
        assert_armed(box, t + 1)


EDGE = mf.FrontConfig(hidden=64, experts=64, top_k=8, latent=448, shared=0)


@pytest.mark.parametrize("select", ["groups", "argmax"])
def test_edge_values_through_the_collect_and_its_plan(select):
    """SPEC sections 4, 5 and 8 through the kernel that collects: the plan of the edge blocks (NaN,
    infinities, saturation at byte 254, +-448, the amax = 448 boundary, E4M3 ties and subnormals)
    bit-equal to the reference plan and to each block's hand-derived scale byte; rows of NaN,
    infinite and tied logits routed as the reference routes them, to top_k distinct ids."""
    edges, want_bytes = edge_latent(EDGE.latent)
    batch = 4
    rng = np.random.default_rng(7)
    latent = rng.normal(0, 3, (batch, EDGE.latent)).astype(edges.dtype)
    latent[: len(edges)] = edges
    logits = rng.normal(size=(batch, EDGE.experts)).astype(np.float32)
    logits[0] = np.nan  # every key NaN: the lowest ids
    logits[1, ::3], logits[1, 1::3] = np.inf, -np.inf  # sigmoid 1 and 0: bit-equal keys
    logits[1, 2::6] = np.nan
    logits[2] = 0.25  # one key for all: ties to the lower id
    box = mb.publish(mf.Mailbox.create(EDGE, capacity=batch), jnp.asarray(logits),
                     jnp.asarray(latent), backend="xla")
    bias = jnp.zeros((EDGE.experts,), jnp.float32)
    want = expected(box, bias, batch)
    *got, box = interpret(box, bias, batch, with_plan=True, config=rt.RouteConfig(2, 4, select))
    values, scales = got.pop(4)
    plan = reference.mxfp8_plan(jnp.asarray(canonical_latent(latent)), EDGE.plan_block)
    assert_bits_equal(values, plan[0])
    assert_bits_equal(scales, plan[1])
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8).reshape(-1)[: len(want_bytes)],
                                  want_bytes)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    assert int(got[4]) == 0
    ids = np.asarray(got[0])
    oracle.assert_valid_ids(ids, EDGE.experts)
    np.testing.assert_array_equal(ids[0], np.arange(EDGE.top_k))
    np.testing.assert_array_equal(ids[2], np.arange(EDGE.top_k))


def test_never_published_rows_time_out_and_the_mailbox_recovers():
    cfg, bias = SMALL, bias_of(SMALL, 1)
    box = mf.Mailbox.create(cfg, capacity=8)
    ids, weights, logits, _, status, box = interpret(box, bias, 3, spin_limit=4)
    assert int(status) == mf.Mailbox.TIMEOUT
    assert np.all(np.asarray(logits).view(np.uint32) == SENTINEL)
    oracle.assert_valid_ids(ids, cfg.experts)
    assert_armed(box, 0)
    # Rows beyond the published batch time out too; the next complete step is clean.
    box = mb.publish(box, *shards_with_negative_zeros(cfg, 2, seed=0), backend="xla")
    *_, status, box = interpret(box, bias, 3, spin_limit=4)
    assert int(status) == mf.Mailbox.TIMEOUT
    assert_armed(box, 1)
    shards = shards_with_negative_zeros(cfg, 3, seed=1)
    box = mb.publish(box, *shards, backend="xla")
    _, _, logits, _, status, box = interpret(box, bias, 3, spin_limit=4)
    assert int(status) == 0
    assert_bits_equal(logits, canonical_logits(shards[0]))
    assert_armed(box, 2)


def test_moe_front_through_the_mailbox_runs_the_kernel_and_equals_direct():
    """``backend="interpret"`` routes the mailbox path through this kernel (in interpret mode): over
    four steps its outputs equal the direct path's (the -0 canonicalization aside), plan included."""
    params = mf.pack_params(weights_of(SMALL, 0), SMALL)
    step = jax.jit(mf.moe_front, static_argnames=("plan", "backend"), donate_argnames="mailbox")
    direct = jax.jit(mf.moe_front, static_argnames=("plan", "backend"))
    box = mf.Mailbox.create(SMALL, capacity=8)
    jaxpr = jax.make_jaxpr(
        lambda x, box: mf.moe_front(x, params, plan=True, backend="interpret", mailbox=box)
    )(rows_of(SMALL, 3, 0), box)
    assert "route_collect" in str(jaxpr) and "name=route\n" not in str(jaxpr)
    for t, batch in enumerate([3, 8, 1, 8]):
        x = rows_of(SMALL, batch, seed=t)
        want = direct(x, params, plan=True, backend="interpret")
        got, box = step(x, params, plan=True, backend="interpret", mailbox=box)
        assert_equals_direct(got, want, SMALL.plan_block)
        assert_armed(box, t + 1)


def test_argument_errors():
    box = mf.Mailbox.create(SMALL, capacity=4)
    bias = bias_of(SMALL, 0)
    zero = jnp.zeros((), jnp.int32)
    buffer, control = box.buffer, box.control
    with pytest.raises(ValueError, match="not a mailbox of 5 or more rows"):
        rc.route_collect(buffer, control, zero, bias, 5, SMALL)
    with pytest.raises(ValueError, match="batch must be a positive int, got 0"):
        rc.route_collect(buffer, control, zero, bias, 0, SMALL)
    with pytest.raises(ValueError, match=r"bias must be \(26,\) float32"):
        rc.route_collect(buffer, control, zero, bias[:3], 2, SMALL)
    with pytest.raises(ValueError, match="status must be an int32 scalar"):
        rc.route_collect(buffer, control, jnp.zeros((1,), jnp.int32), bias, 2, SMALL)
    with pytest.raises(ValueError, match=r"buffer \(\) and control \(2,\) are not a mailbox"):
        rc.route_collect("box", control, zero, bias, 2, SMALL)
    with pytest.raises(ValueError, match=r"and control \(1,\) are not a mailbox of 2 or more rows"):
        rc.route_collect(buffer, control[:1], zero, bias, 2, SMALL)
    with pytest.raises(ValueError, match="are not a mailbox of 2 or more rows laid out for"):
        rc.route_collect(buffer, control, zero, bias_of(WIDE, 0), 2, WIDE)
    odd = mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=36, shared=0, plan_block=3)
    assert rc.fuses_plan(SMALL) and rc.fuses_plan(mf.KIMI_K3) and not rc.fuses_plan(odd)
    odd_box = mf.Mailbox.create(odd, capacity=4)
    with pytest.raises(NotImplementedError, match="plan_block that is a power of two >= 2, got 3"):
        rc.route_collect(odd_box.buffer, odd_box.control, zero, bias_of(odd, 0), 2, odd,
                         with_plan=True)


@pytest.mark.parametrize(
    "batch, with_plan, config",
    [(1, False, None), (64, True, None), (256, False, None), (256, True, None),
     (8, True, rt.RouteConfig(1, 4)), (8, False, rt.RouteConfig(2, 8, "groups"))],
)
def test_lowers_for_h200_as_one_kernel_updating_the_mailbox_in_place(batch, with_plan, config):
    cfg = mf.KIMI_K3
    box = mf.Mailbox.create(cfg, capacity=256)
    text = lower_for_h200(
        lambda box, status, bias: on_mailbox(
            box, status, bias, batch, with_plan=with_plan, config=config
        ),
        box, jnp.zeros((), jnp.int32), bias_of(cfg, 0),
    )
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "output_operand_aliases" in text
    for op in ("stablehlo.sort", "stablehlo.gather", "stablehlo.divide", "stablehlo.dynamic_update"):
        assert op not in text, (batch, op)


def test_byte_count():
    """Per row: the row read (L/2 + E words), written out as logits (4E) and latent (2L) bytes,
    re-armed; the chosen logits read back, ids and weights written; the bias once."""
    cfg, batch = mf.KIMI_K3, 64
    row = 2 * cfg.latent + 4 * cfg.experts
    per_row = row + (4 * cfg.experts + 2 * cfg.latent) + row + 4 * cfg.top_k + (4 + 2) * cfg.top_k
    assert rc.route_collect_bytes(batch, cfg) == batch * per_row + 4 * cfg.experts
    plan = batch * cfg.latent + batch * cfg.latent // 32  # e4m3 values and E8M0 scales
    assert rc.route_collect_bytes(batch, cfg, with_plan=True) == batch * per_row + 4 * cfg.experts + plan


# ---- GPU: the kernel against the jax-triton collect and the routing kernel ------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_gpu_equals_the_collect_kernel_then_the_route_and_plan_kernels(batch):
    cfg = mf.KIMI_K3
    bias = bias_of(cfg, 2)
    fused = jax.jit(
        lambda box, s: on_mailbox(box, s, bias, batch, with_plan=True), donate_argnums=0
    )
    box = mf.Mailbox.create(cfg, capacity=256)
    plain = mf.Mailbox.create(cfg, capacity=256)
    for t in range(3):
        shards = shards_with_negative_zeros(cfg, batch, seed=10 * batch + t)
        box = mb.publish(box, *shards, backend="pallas")
        plain = mb.publish(plain, *shards, backend="pallas")
        *got, box = fused(box, jnp.zeros((), jnp.int32))
        logits, latent, status, plain = mb.collect(plain, batch, backend="pallas")
        ids, weights = rt.route(logits, bias, cfg)
        values, scales = pallas_plan.plan(latent, cfg.plan_block)
        want = (ids, weights, logits, latent, (values, scales), status)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_bits_equal(g, w)
        assert int(got[-1]) == 0
        assert_bits_equal(box.buffer, plain.buffer)
        assert_armed(box, t + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("select", ["groups", "argmax"])
def test_gpu_never_published_rows_time_out_within_a_second(select):
    """Every program polls its row ``ROUTE_COLLECT_SPIN_LIMIT`` times; the ids are then the routing of
    the sentinel row (what collect-then-route returns), call after call."""
    cfg, batch = mf.KIMI_K3, 256
    bias = bias_of(cfg, 3)
    picked = rt.pick_config(batch, cfg.experts, cfg.top_k)
    config = rt.RouteConfig(picked.block_rows, picked.num_warps, select)
    run = jax.jit(
        lambda box: on_mailbox(box, jnp.zeros((), jnp.int32), bias, batch, config=config),
        donate_argnums=0,
    )
    box = mf.Mailbox.create(cfg, capacity=256)
    *_, status, box = run(box)  # compiles; times out too
    assert int(status) == mf.Mailbox.TIMEOUT
    for _ in range(3):
        start = time.perf_counter()
        ids, weights, logits, _, status, box = jax.block_until_ready(run(box))
        elapsed = time.perf_counter() - start
        assert int(status) == mf.Mailbox.TIMEOUT
        assert elapsed < 1.0, f"the timed-out route_collect took {elapsed:.3f} s"
        assert np.all(np.asarray(logits).view(np.uint32) == SENTINEL)
        want = rt.route(logits, bias, cfg, config=config)
        assert_bits_equal(ids, want[0])
        assert_bits_equal(weights, want[1])
        assert_armed(box, 0)
