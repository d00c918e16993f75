"""The Pallas front GEMM (and its MXFP8 plan epilogue): interpret mode against the reference, lowering
for an H200 from the CPU host at every tp shape, the tuning table, and on a GPU against float64."""

import dataclasses
import functools
import importlib
import json
from importlib import resources

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import registry, reference
from moe_front_jax import mailbox as mb
from moe_front_jax.params import padded_split
from moe_front_jax.pallas.front_gemm import kernel as fg
from moe_front_jax.pallas.gemm import schedule
from moe_front_jax.reference import mailbox as layout
from bitwise import plan_bytes
from engine_cases import exact_front, product
from h200 import H200, lower_for_h200, triton_ir_for_h200
from kimi_k3 import k3_weights
from mailbox_cases import tickets_of
import oracle

K3 = mf.KIMI_K3
SMALL_HIDDEN = 256
"""Interpret mode keeps K3's row counts and shrinks the hidden size (the GEMM's K)."""
Grid, SK, Vec = schedule.GridConfig, schedule.StreamKConfig, schedule.VectorConfig


def from_json(entry):
    return schedule.config_from_json(entry, schedule.TRITON_CONFIGS)


def k3_shape(tp, split=None):
    cfg = K3.with_tp(tp)
    valid, shard = cfg.experts_per_rank, cfg.latent_per_rank
    return valid, padded_split(valid) if split is None else split, shard


@functools.partial(jax.jit, static_argnames=("split", "valid", "plan", "config"))
def interpret(x, w, *, split, valid, plan, config):
    if plan:
        return fg.front_gemm_plan(x, w, split, valid, interpret=True, config=config)
    return fg.front_gemm(x, w, split, valid, interpret=True, config=config)


# (tp, batch, split or None for pack_params', config, plan): split-K and single-pass tiles, router and
# latent tiles that run past their region (valid % block_rows, shard % block_rows), B below, at and
# above 16, a split off every alignment, and tiles too narrow for a plan block (widened to 32).
INTERPRET_CASES = [
    (1, 1, None, Grid(32, 64, 2, 4, 3), False),
    (2, 37, None, Grid(64, 64, 4, 4, 3), True),
    (4, 3, None, Grid(16, 64, 1, 4, 3), True),
    (8, 255, None, Grid(128, 128, 1, 8, 3), True),
    (8, 7, 120, Grid(32, 64, 4, 4, 3), True),
    (16, 16, None, Grid(64, 32, 8, 4, 3), True),
    # Stream-K: runs of iterations shorter than a tile (several contributors a tile, the last one's
    # run cut short), longer than a tile (one program over several tiles, router and latent), and
    # more programs than iterations (the trailing programs have none).
    (1, 1, None, SK(32, 64, 4, 3, 132), False),
    (2, 37, None, SK(64, 64, 4, 3, 7), True),
    (8, 3, 120, SK(32, 32, 4, 3, 29), True),
    (8, 16, None, SK(128, 128, 8, 3, 64), True),
    # The vector schedule: one row per program, tiles that run past their region (112 % 32, and a
    # split off every alignment), and the largest batch it takes.
    (8, 1, None, Vec(1, 64, 4), False),
    (8, 3, 120, Vec(32, 32, 4), False),
    (1, 8, None, Vec(16, 128, 4), False),
]


@pytest.mark.parametrize("tp, batch, split, config, plan", INTERPRET_CASES)
def test_interpret_matches_reference_exactly(tp, batch, split, config, plan):
    valid, split, shard = k3_shape(tp, split)
    x, w = exact_front(batch, seed=tp, hidden=SMALL_HIDDEN, valid=valid, split=split, shard=shard)
    out = interpret(x, w, split=split, valid=valid, plan=plan, config=config)
    y = product(x, w)
    ref_logits, ref_latent = reference.front_gemm(x, w, split, valid)
    np.testing.assert_array_equal(np.asarray(out[0]), y[:, :valid].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref_logits))
    np.testing.assert_array_equal(
        np.asarray(out[1]).view(np.uint16), np.asarray(ref_latent).view(np.uint16)
    )
    assert out[1].dtype == jnp.bfloat16 and out[1].shape == (batch, shard)
    if plan:
        values, scales = out[2]
        assert values.dtype == jnp.float8_e4m3fn and values.shape == (batch, shard)
        assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (batch, shard // 32)
        ref_values, ref_scales = plan_bytes(reference.mxfp8_plan(ref_latent))
        np.testing.assert_array_equal(plan_bytes(out[2])[0], ref_values)
        np.testing.assert_array_equal(plan_bytes(out[2])[1], ref_scales)
        # And against the float64 oracle written from the SPEC.
        oracle_values, oracle_scales = oracle.mxfp8_plan(np.asarray(ref_latent))
        np.testing.assert_array_equal(plan_bytes(out[2])[1], oracle_scales)
        np.testing.assert_array_equal(plan_bytes(out[2])[0], oracle_values.view(np.uint8))


@pytest.mark.parametrize("config", [
    Grid(32, 32, 1, 4, 3),  # one chain over all 8 steps
    Grid(32, 32, 2, 4, 3),  # chains of 4 steps
    SK(32, 32, 4, 3, 29),  # runs that start and end off the fold boundaries
    SK(64, 32, 4, 3, 7),  # runs over several tiles
])
def test_interpret_folded_accumulator_counts_every_step_once(monkeypatch, config):
    """With ``FOLD_K`` cut to 3 steps of 32 (so the fold fires at K positions a run starts and ends
    between), exact data still gives the float64 product bit for bit: no step is dropped or added
    twice by the fold."""
    monkeypatch.setattr(fg, "FOLD_K", 96)
    valid, split, shard = k3_shape(8)
    x, w = exact_front(5, seed=4, hidden=SMALL_HIDDEN, valid=valid, split=split, shard=shard)
    logits, latent = fg.front_gemm(x, w, split, valid, interpret=True, config=config)
    y = product(x, w)
    np.testing.assert_array_equal(np.asarray(logits), y[:, :valid].astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(latent).view(np.uint16), y[:, split:].astype(ml_dtypes.bfloat16).view(np.uint16)
    )


def test_interpret_plan_of_non_finite_latent():
    """inf, NaN and -0 in the latent (from inf and NaN in x): the plan still equals the reference's."""
    valid, split, shard = k3_shape(8)
    x, w = exact_front(6, seed=3, hidden=SMALL_HIDDEN, valid=valid, split=split, shard=shard)
    x = x.at[1, 5].set(jnp.inf).at[2, 9].set(jnp.nan).at[3].set(-0.0).at[4, 0].set(3e38)
    logits, latent, planned = interpret(
        x, w, split=split, valid=valid, plan=True, config=Grid(32, 64, 2, 4, 3)
    )
    ref_logits, ref_latent = reference.front_gemm(x, w, split, valid)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))
    np.testing.assert_array_equal(np.asarray(latent, np.float32), np.asarray(ref_latent, np.float32))
    assert np.isnan(np.asarray(latent, np.float32)).any() and np.isinf(np.asarray(latent, np.float32)).any()
    for got, want in zip(plan_bytes(planned), plan_bytes(reference.mxfp8_plan(latent))):
        np.testing.assert_array_equal(got, want)


def test_moe_front_takes_the_plan_from_the_gemm_epilogue(spy):
    # The function the registry names as the stage's kernel, wrapped where the registry loads it.
    module, name = registry.STAGES["front_gemm_plan"].kernel.split(":")
    calls = spy(name, importlib.import_module(module))
    registry.load.cache_clear()
    cfg = mf.FrontConfig(hidden=SMALL_HIDDEN, experts=128, top_k=16, latent=256, shared=0)
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg, shared=False), cfg)
    x = jax.random.normal(jax.random.key(1), (5, SMALL_HIDDEN)).astype(jnp.bfloat16)
    try:
        got = jax.jit(lambda x, p: mf.moe_front(x, p, plan=True, backend="interpret"))(x, params)
    finally:
        registry.load.cache_clear()
    want = mf.moe_front(x, params, plan=True, backend="xla")
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=0, atol=1e-5)
    # The routing kernel (interpret mode) on the kernel's own logits gives the reference's routing.
    ref_ids, ref_weights = reference.route(got.logits, params.bias, cfg)
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(ref_ids))
    np.testing.assert_array_equal(
        np.asarray(got.weights).view(np.uint16), np.asarray(ref_weights).view(np.uint16)
    )
    assert oracle.bf16_ulp_distance(got.latent, want.latent).max() <= 1
    for a, b in zip(plan_bytes(got.plan), plan_bytes(reference.mxfp8_plan(got.latent))):
        np.testing.assert_array_equal(a, b)


# Mailbox rows of 26 or 25 experts and 36 latent columns (18 latent words) at tp = 1: tiles of every
# schedule that run past their region (with 25, the last two-row router tile too), and one-row
# vector blocks, published in pairs.
PUBLISH_CFG = mf.FrontConfig(hidden=SMALL_HIDDEN, experts=26, top_k=4, latent=36, shared=0,
                             plan_block=4)
ODD_CFG = mf.FrontConfig(hidden=SMALL_HIDDEN, experts=25, top_k=4, latent=36, shared=0,
                         plan_block=4)
PUBLISH_CONFIGS = [
    Grid(16, 64, 1, 4, 3),
    Grid(16, 64, 2, 4, 3),
    SK(32, 32, 4, 3, 5),
    Vec(1, 64, 4),
    Vec(2, 128, 4),
    Vec(8, 64, 4),
]


def publish_operands(batch, seed, cfg=PUBLISH_CFG, exact=True):
    """``x``, ``w`` and ``split`` for ``cfg``: exact operands, or random ones (whose float32 sums
    depend on the schedule)."""
    split = padded_split(cfg.experts)
    if exact:
        x, w = exact_front(batch, seed=seed, hidden=cfg.hidden, valid=cfg.experts, split=split,
                           shard=cfg.latent)
        return x, w, split
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, cfg.hidden)).astype(ml_dtypes.bfloat16)
    w = rng.normal(size=(split + cfg.latent, cfg.hidden)).astype(ml_dtypes.bfloat16)
    w[cfg.experts:split] = 0
    return jnp.asarray(x), jnp.asarray(w), split


def publish_into(box, x, w, split, valid, **kwargs):
    """``fg.front_gemm_publish`` into the mailbox's arrays; returns ``(mailbox, status)``, the
    mailbox rebuilt from the buffer, control and tickets it returns."""
    buffer, control, tickets, status = fg.front_gemm_publish(
        x, w, split, valid, box.buffer, box.control, box.tickets, box.cfg, **kwargs)
    return dataclasses.replace(box, buffer=buffer, control=control, tickets=tickets), status


def published_buffers(cfg, steps, publish):
    """The mailbox buffers after ``publish(box, batch, seed)`` at each of ``steps`` (batch, seed),
    each step collected (re-armed) in plain JAX before the next. The tile counters, kept in the
    mailbox from step to step, must be zero after each."""
    box, buffers = mf.Mailbox.create(cfg, capacity=8, generations=2), []
    for seed, batch in enumerate(steps):
        box, status = publish(box, batch, seed)
        assert status is None or (status.shape == () and int(status) == 0)
        np.testing.assert_array_equal(np.asarray(box.tickets), np.zeros(tickets_of(cfg)))
        buffers.append((np.asarray(box.buffer), np.asarray(box.control)))
        *_, box = mb.collect(box, batch, backend="xla")
    return buffers


@pytest.mark.parametrize("cfg", [PUBLISH_CFG, ODD_CFG], ids=["even", "odd"])
@pytest.mark.parametrize("config, plan_block", [(c, None) for c in PUBLISH_CONFIGS] + [
    (Grid(16, 64, 2, 4, 3), 4)])
def test_interpret_publish_equals_publishing_the_outputs(cfg, config, plan_block):
    """``front_gemm_publish`` leaves in the mailbox exactly what ``mailbox.publish`` (plain JAX) leaves
    from ``front_gemm``'s outputs (``front_gemm_plan``'s with ``plan_block``) with the same schedule,
    generation by generation."""
    def gemm_then_publish(box, batch, seed):
        x, w, split = publish_operands(batch, seed, cfg)
        if plan_block is None:
            out = fg.front_gemm(x, w, split, cfg.experts, interpret=True, config=config)
        else:
            out = fg.front_gemm_plan(x, w, split, cfg.experts, plan_block, interpret=True,
                                     config=config)
        return mb.publish(box, *out[:2], backend="xla"), None

    def publish(box, batch, seed):
        x, w, split = publish_operands(batch, seed, cfg)
        return publish_into(box, x, w, split, cfg.experts, interpret=True, config=config,
                            plan_block=plan_block)

    steps = (3, 8, 1)
    for got, want in zip(published_buffers(cfg, steps, publish),
                         published_buffers(cfg, steps, gemm_then_publish)):
        np.testing.assert_array_equal(got[1], want[1])  # the control words
        np.testing.assert_array_equal(got[0], want[0])


def test_publish_takes_the_plan_schedule_with_plan_block(monkeypatch):
    """Without a config, ``plan_block`` picks ``front_gemm_plan``'s schedule (here a tensor-core one,
    where ``front_gemm``'s is a vector one): on random data the two give different sums, and the
    words are those of the plan's schedule."""
    vector, grid = Vec(2, 64, 4), Grid(16, 64, 2, 4, 3)
    monkeypatch.setattr(fg, "pick_config", lambda *shape, plan=False: grid if plan else vector)
    cfg, batch = PUBLISH_CFG, 3
    x, w, split = publish_operands(batch, seed=5, exact=False)
    empty = mf.Mailbox.create(cfg, capacity=4)
    plain = mb.publish(empty, *fg.front_gemm(x, w, split, cfg.experts, interpret=True),
                       backend="xla")
    planned = mb.publish(
        empty, *fg.front_gemm_plan(x, w, split, cfg.experts, cfg.plan_block, interpret=True)[:2],
        backend="xla")
    assert not np.array_equal(np.asarray(plain.buffer), np.asarray(planned.buffer))
    for plan_block, want in ((None, plain), (cfg.plan_block, planned)):
        got, _ = publish_into(mf.Mailbox.create(cfg, capacity=4), x, w, split, cfg.experts,
                              plan_block=plan_block, interpret=True)
        np.testing.assert_array_equal(np.asarray(got.buffer), np.asarray(want.buffer))


def test_epilogue_latent_words_canonicalize_negative_zero():
    """The epilogue's latent word helpers against the SPEC's rule, in numpy: a bfloat16 -0 becomes
    +0, and the smallest negative subnormal, which shares its sign bit, passes unchanged. (A GEMM on
    the CPU cannot give a -0: its float32 sums start at +0 and flush subnormals. The logits go
    through ``mailbox.logits_to_words``, as the plain-JAX publish's do.)"""
    halves = np.array([[0x8000, 0x8000, 0x8001, 0x8000, 0x3F80, 0xBF80]], np.uint16)
    latent = jnp.asarray(halves.view(ml_dtypes.bfloat16))
    canonical = np.where(halves == 0x8000, 0, halves).astype(np.uint32)
    want = canonical[:, 0::2] | (canonical[:, 1::2] << 16)
    np.testing.assert_array_equal(np.asarray(fg.latent_words_of(latent)), want)
    np.testing.assert_array_equal(
        np.asarray(layout.latent_word_pairs(latent[:, 0::2], latent[:, 1::2])), want)


def test_publish_errors():
    cfg = PUBLISH_CFG
    x, w, split = publish_operands(3, seed=0)
    box = mf.Mailbox.create(cfg, capacity=2)
    with pytest.raises(ValueError, match="over the mailbox capacity 2"):
        publish_into(box, x, w, split, cfg.experts)
    box = mf.Mailbox.create(cfg, capacity=4)
    with pytest.raises(ValueError, match="valid=25 router rows and 36 latent rows must be the "
                                         "mailbox's experts=26 and latent=36"):
        publish_into(box, x, w, split, cfg.experts - 1)
    tp2 = mf.FrontConfig(hidden=SMALL_HIDDEN, experts=26, top_k=4, latent=36, shared=0, tp=2,
                         plan_block=2)
    # A mailbox of tp > 1 is a valid request that the kernel does not cover (``covers_publish``).
    with pytest.raises(NotImplementedError,
                       match="one device's rows \\(tp=1\\), got a mailbox for tp=2"):
        publish_into(mf.Mailbox.create(tp2, capacity=4), x, w, split, cfg.experts)
    # The mailbox's arrays, each named with its shape and what was expected.
    arrays = (box.buffer, box.control, box.tickets)
    for index, bad, message in (
        (0, box.buffer[..., :-4], r"buffer is \(3, 4, 40\) uint32, expected \(G, capacity, 44\) "
                                  r"uint32"),
        (0, box.buffer[0], r"buffer is \(4, 44\) uint32, expected \(G, capacity, 44\) uint32"),
        (1, box.control.astype(jnp.uint32), r"control is \(2,\) uint32, expected \(2\) int32"),
        (2, box.tickets[:-1], r"tickets is \(4,\) int32, expected \(5\) int32"),
    ):
        given = list(arrays)
        given[index] = bad
        with pytest.raises(ValueError, match=message):
            fg.front_gemm_publish(x, w, split, cfg.experts, *given, cfg)
    for plan_block in (3, 8, 512, True):
        with pytest.raises(ValueError, match=f"plan_block must be None or a power of two in "
                                             f"\\[1, 256\\] dividing the latent shard \\(36\\), "
                                             f"got {plan_block}"):
            publish_into(box, x, w, split, cfg.experts, plan_block=plan_block)
    with pytest.raises(ValueError, match="plan_block asks for front_gemm_plan's schedule, a "
                                         "tensor-core one, but config is the vector schedule"):
        publish_into(box, x, w, split, cfg.experts, plan_block=4,
                     config=Vec(2, 64, 4))


@pytest.mark.parametrize("plan", [False, True])
def test_gemm_exchange_route_without_the_kernel_equals_the_reference_path(plan):
    """Where the backend does not run the front GEMM kernel (``"xla"``), ``gemm_exchange_route`` runs
    the stage's reference (the XLA GEMM, then the plain-JAX publish): over steps of several batches
    (generations rotating), the same bits as ``reference.front_gemm`` followed by ``exchange_route``,
    and the same mailbox words, control and tile counters afterwards."""
    cfg = PUBLISH_CFG
    _, w, split = publish_operands(1, seed=0, exact=False)
    rng = np.random.default_rng(6)
    params = mf.pack_params({"gate.weight": w[:cfg.experts], "routed_down_weight": w[split:],
                             "gate.e_score_correction_bias":
                                 jnp.asarray(rng.uniform(-0.05, 0.05, cfg.experts), jnp.float32)},
                            cfg)
    assert params.split == split
    gemm = jax.jit(reference.front_gemm, static_argnums=(2, 3))
    got_box = mf.Mailbox.create(cfg, capacity=8)
    want_box = mf.Mailbox.create(cfg, capacity=8)
    for t, batch in enumerate((3, 8, 1, 8)):
        x, _, _ = publish_operands(batch, seed=10 + t, exact=False)
        *got, got_box = mb.gemm_exchange_route(
            got_box, x, params.packed, params.bias, split=params.split, valid=cfg.experts,
            backend="xla", plan=plan, plan_block=cfg.plan_block if plan else None)
        logits, latent = gemm(x, params.packed, params.split, cfg.experts)
        *want, want_box = mb.exchange_route(want_box, logits, latent, params.bias, backend="xla",
                                            plan=plan)
        assert (got[4] is None) == (not plan) == (want[4] is None)
        assert int(got[5]) == 0
        got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
        assert len(got_leaves) == len(want_leaves) == (7 if plan else 5)
        for g, v in zip(got_leaves, want_leaves):
            assert g.dtype == v.dtype and g.shape == v.shape
            np.testing.assert_array_equal(np.atleast_1d(np.asarray(g)).view(np.uint8),
                                          np.atleast_1d(np.asarray(v)).view(np.uint8))
        for g, v in zip(jax.tree.leaves(got_box), jax.tree.leaves(want_box)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(v))
        np.testing.assert_array_equal(np.asarray(got_box.tickets), np.zeros(tickets_of(cfg)))
        np.testing.assert_array_equal(np.asarray(got_box.control), [t % 3, t % 3])


def test_publish_lowers_for_h200_as_one_kernel_updating_the_mailbox_in_place():
    """At Kimi-K3's tp = 1 shapes, with the tuned schedules of every kind (vector at B = 1 and 2,
    stream-K at B = 8 and 64, split-K at B = 256): one Triton kernel whose outputs 0 and 1 are the
    mailbox's buffer and control operands, whose tile counters are the mailbox's tickets (updated in
    place: no zeroing kernel before it, which ``front_gemm`` has), and no cast, slice or dot around
    it."""
    valid, split, shard = k3_shape(1)
    w = jnp.zeros((split + shard, K3.hidden), jnp.bfloat16)
    box = mf.Mailbox.create(K3, capacity=256)
    for batch in (1, 2, 8, 64, 256):
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        text = lower_for_h200(
            lambda x, w, box: fg.front_gemm_publish(x, w, split, valid, box.buffer, box.control,
                                                    box.tickets, box.cfg), x, w, box)
        assert text.count("__gpu$xla.gpu.triton") == 1
        operands = 3 if batch >= 8 else 2  # the tile counters come first
        for output, operand in ((0, operands), (1, operands + 1)):
            assert (f"output_tuple_indices = [{output}], operand_index = {operand}" in text), batch
        if batch >= 8:  # the counters: the mailbox's 280 tickets (%arg4), the kernel's last output
            assert "%arg4: tensor<280xi32>" in text, batch
            assert "triton(%arg0, %arg1, %arg4, %arg2, %arg3)" in text, batch
            assert "output_tuple_indices = [4], operand_index = 2" in text, batch
            direct = lower_for_h200(lambda x, w: fg.front_gemm(x, w, split, valid), x, w)
            assert "stablehlo.broadcast_in_dim" in direct  # the fresh counters it zeroes
        for op in ("stablehlo.convert", "stablehlo.slice", "stablehlo.dot_general",
                   "stablehlo.broadcast_in_dim", "stablehlo.constant"):
            assert op not in text, (batch, op)


@pytest.mark.parametrize("batch", [8, 64, 256])
def test_publish_epilogue_stores_16_byte_vectors_on_sm90(batch, monkeypatch, tmp_path):
    """Compiled for sm_90 by Triton alone (no GPU), the tuned stream-K (B = 8, 64) and split-K
    (B = 256) schedules publish the words with as many 16-byte stores as ``front_gemm`` stores its
    outputs with; its 32-bit stores are ``front_gemm``'s (the tile counters' re-arm) and the control
    and status words. (With the word column divided by Python's ``//``, B = 64 stored the latent's
    words with 32 separate 32-bit stores.)"""
    triton = pytest.importorskip("triton", reason="no triton: Linux-only wheels")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # see the mailbox kernels' compile test
    from triton.backends.compiler import GPUTarget

    valid, split, shard = k3_shape(1)
    config = fg.load_table("NVIDIA H200")[(fg.table_key(valid, shard, K3.hidden, batch), False)]
    w = jnp.zeros((split + shard, K3.hidden), jnp.bfloat16)
    x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
    box = mf.Mailbox.create(K3, capacity=256)
    kernels = {
        "direct": triton_ir_for_h200(lambda x, w: fg.front_gemm(x, w, split, valid), x, w),
        "publish": triton_ir_for_h200(
            lambda x, w, box: fg.front_gemm_publish(x, w, split, valid, box.buffer, box.control,
                                                    box.tickets, box.cfg), x, w, box),
    }
    stores = {}
    for name, [ttir] in kernels.items():
        path = tmp_path / f"{name}.ttir"
        path.write_text(ttir)
        compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=config.num_warps,
                                               num_stages=config.num_stages))
        ptx = compiled.asm["ptx"]
        stores[name] = (ptx.count("st.global.v4.b32"), ptx.count("st.global.b32"))
    assert stores["direct"][1] <= 4, stores  # a counter's re-arm per segment of a program
    assert stores["publish"] == (stores["direct"][0], stores["direct"][1] + 2), stores


@pytest.mark.parametrize("programs", [0, 264])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_lowers_for_h200_as_one_kernel(tp, programs):
    """One Triton kernel per call (plus, when K is split, a zeroed counter), no cast or slice ops;
    the tuned grid, and stream-K over 264 programs."""
    valid, split, shard = k3_shape(tp)
    w = jnp.zeros((split + shard, K3.hidden), jnp.bfloat16)
    for batch in (1, 64, 256):
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        config = None
        if programs:
            bn = 32 if batch <= 64 else 64
            config = SK(bn, 128 if batch <= 64 else 64, 4, 3, programs)
        for fn in (fg.front_gemm, fg.front_gemm_plan):
            text = lower_for_h200(lambda x, w: fn(x, w, split, valid, config=config), x, w)
            assert text.count("__gpu$xla.gpu.triton") == 1
            for op in ("stablehlo.convert", "stablehlo.slice", "stablehlo.dot_general"):
                assert op not in text, (tp, batch, fn.__name__, op)


def test_table_covers_the_k3_shapes_and_is_used_on_h200():
    text = resources.files("moe_front_jax.pallas").joinpath("tuning", "nvidia-h200", "front_gemm.json")
    table = json.loads(text.read_text())
    assert table["device_kind"] == H200.device_kind
    for tp in (1, 2, 4, 8):
        valid, _, shard = k3_shape(tp)
        for batch in (16, 32, 64, 128, 256):
            entry = table["entries"][fg.table_key(valid, shard, K3.hidden, batch)]
            cfg = from_json(entry["config"])
            # The plan's own schedule where one was tuned, else the plain one (widened by the kernel).
            plan_cfg = from_json(entry.get("plan_config", entry["config"]))
            for c in (cfg, plan_cfg):
                c.check_divides(K3.hidden, "H")  # raises where it does not
            mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
            with jax.sharding.use_abstract_mesh(mesh):
                assert fg.pick_config(valid, shard, K3.hidden, batch) == cfg
                assert fg.pick_config(valid, shard, K3.hidden, batch, plan=True) == plan_cfg
                # Batches share the entry of their padded size.
                assert fg.pick_config(valid, shard, K3.hidden, batch // 2 + 1) == cfg
        with jax.sharding.use_abstract_mesh(mesh):
            # Batches below 16: their own power of two's entry where the table has one (the
            # vector schedules), else the entry of 16.
            for batch in (1, 2, 3, 5, 8):
                key = fg.table_key(valid, shard, K3.hidden, batch)
                entry = table["entries"].get(key) or table["entries"][
                    fg.table_key(valid, shard, K3.hidden, 16)]
                assert fg.pick_config(valid, shard, K3.hidden, batch) == from_json(entry["config"])


def test_table_vector_entries(monkeypatch):
    """A batch's own vector entry serves the plain GEMM; the plan, which a vector schedule cannot
    write, and batches without an entry of their own take the padded batch's entry."""
    valid, _, shard = k3_shape(8)
    vector = dict(implementation="triton_vector", block_rows=4, block_k=512, num_warps=4)
    grid = dict(implementation="triton_grid", block_rows=32, block_k=64, split_k=8, num_warps=4,
                num_stages=6)
    entries = {fg.table_key(valid, shard, K3.hidden, 1): {"config": vector},
               fg.table_key(valid, shard, K3.hidden, 16): {"config": grid}}
    monkeypatch.setattr(
        fg, "tuning_entries", lambda kind, table: entries if table == "front_gemm" else {})
    fg.load_table.cache_clear()
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            assert fg.pick_config(valid, shard, K3.hidden, 1) == Vec(4, 512, 4)
            assert fg.pick_config(valid, shard, K3.hidden, 1, plan=True) == Grid(32, 64, 8, 4, 6)
            assert fg.pick_config(valid, shard, K3.hidden, 2) == Grid(32, 64, 8, 4, 6)
    finally:
        fg.load_table.cache_clear()


@pytest.mark.parametrize("hidden", [7168, 256, 48])
@pytest.mark.parametrize("batch", [1, 37, 256])
def test_heuristic_config_divides_the_problem(hidden, batch):
    for tp in (1, 8, 16):
        valid, _, shard = k3_shape(tp)
        cfg = fg.heuristic_config(valid, shard, hidden, batch, cores=132)
        assert hidden % (cfg.split_k * cfg.block_k) == 0
        assert cfg.block_rows >= 32 and 2 * cfg.num_stages * cfg.block_k * (
            cfg.block_rows + fg.padded_batch(batch)) <= 160 * 1024
        tiles = -(-valid // cfg.block_rows) + -(-shard // cfg.block_rows)
        if hidden == 7168:  # room to split: every SM gets a program
            assert tiles * cfg.split_k >= 132
    assert fg.pick_config(112, 448, 256, 3) == fg.heuristic_config(112, 448, 256, 3, 132)


@pytest.mark.parametrize("tp", [1, 8])
def test_vector_schedule_lowers_for_h200_as_one_kernel(tp):
    """No counters and no zeroing: one Triton kernel, nothing else, at the batches it covers."""
    valid, split, shard = k3_shape(tp)
    w = jnp.zeros((split + shard, K3.hidden), jnp.bfloat16)
    config = Vec(4 if tp == 8 else 32, 512, 4)
    for batch in (1, 4, 8):
        x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
        text = lower_for_h200(lambda x, w: fg.front_gemm(x, w, split, valid, config=config), x, w)
        assert text.count("__gpu$xla.gpu.triton") == 1
        for op in ("stablehlo.broadcast", "stablehlo.convert", "stablehlo.slice",
                    "stablehlo.dot_general"):
            assert op not in text, (tp, batch, op)


def test_vector_config_errors():
    with pytest.raises(ValueError, match=r"VectorConfig.block_rows must be a power of two >= 1, got 3"):
        Vec(3, 64, 4)
    with pytest.raises(ValueError, match=r"VectorConfig.num_warps must be a positive int, got 0"):
        Vec(4, 64, 0)
    valid, split, shard = k3_shape(8)
    w = jnp.zeros((split + shard, 64), jnp.bfloat16)
    vector = Vec(4, 64, 4)
    with pytest.raises(ValueError, match="no plan epilogue"):
        fg.front_gemm_plan(jnp.zeros((2, 64), jnp.bfloat16), w, split, valid, config=vector)
    with pytest.raises(ValueError, match="covers B <= 8, got B=9"):
        fg.front_gemm(jnp.zeros((9, 64), jnp.bfloat16), w, split, valid, config=vector)


def test_a_config_of_another_implementation_is_refused():
    """The front GEMM runs the three Triton schedules only: the shared expert's TMA config is a
    ValueError naming what it takes."""
    from moe_front_jax.pallas.shared_expert.tma import TmaConfig
    valid, split, shard = k3_shape(8)
    w = jnp.zeros((split + shard, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="config must be a GridConfig, StreamKConfig, VectorConfig"):
        fg.front_gemm(jnp.zeros((2, 64), jnp.bfloat16), w, split, valid,
                      config=TmaConfig(64, 64, 1, 2))


def test_stream_k_config_errors():
    with pytest.raises(ValueError, match="StreamKConfig.programs must be a positive int, got -1"):
        SK(32, 64, 4, 3, -1)
    with pytest.raises(ValueError, match="StreamKConfig.block_k must be a power of two >= 16"):
        SK(32, 8, 4, 3, 132)


def test_tables_name_their_implementation():
    """Every config of the shipped table names its implementation, and only those names load."""
    assert from_json({"implementation": "triton_stream_k", "block_rows": 32, "block_k": 64,
                      "num_warps": 4, "num_stages": 3, "programs": 132}) == SK(32, 64, 4, 3, 132)
    with pytest.raises(ValueError, match="implementation must be one of"):
        from_json({"block_rows": 32, "block_k": 64, "split_k": 1, "num_warps": 4, "num_stages": 3})
    with pytest.raises(ValueError, match="implementation must be one of"):
        from_json({"implementation": "mosaic_tma", "block_rows": 64, "block_k": 64, "split_k": 1,
                   "num_stages": 2})
    text = resources.files("moe_front_jax.pallas").joinpath("tuning", "nvidia-h200", "front_gemm.json")
    for entry in json.loads(text.read_text())["entries"].values():
        for name in ("config", "plan_config"):
            if name in entry:
                assert schedule.config_to_json(from_json(entry[name])) == entry[name]


def test_select_names_the_implementation_and_why():
    valid, _, shard = k3_shape(1)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        vector = fg.select(valid, shard, K3.hidden, 1)
        plan = fg.select(valid, shard, K3.hidden, 1, plan=True)
        heuristic = fg.select(112, 448, 256, 3)
    assert (vector.implementation, type(vector.config)) == ("triton_vector", Vec)
    assert vector.reason == "NVIDIA H200 table, batch 1"
    # The vector entry's own plan schedule, a tensor-core one: the plan has no vector epilogue.
    assert plan.implementation == "triton_stream_k" and plan.reason == "NVIDIA H200 table, batch 1"
    assert heuristic.implementation == "triton_grid" and heuristic.reason.startswith("heuristic")
    assert heuristic.config == fg.heuristic_config(112, 448, 256, 3, H200.num_cores)


def test_errors():
    valid, split, shard = k3_shape(8)
    w = jnp.zeros((split + shard, 64), jnp.bfloat16)
    x = jnp.zeros((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="x must be a 2-D bfloat16 array"):
        fg.front_gemm(x.astype(jnp.float32), w, split, valid)
    with pytest.raises(ValueError, match="packed must have x's width 64"):
        fg.front_gemm(x, w[:, :32], split, valid)
    with pytest.raises(ValueError, match="x is an empty batch"):
        fg.front_gemm(x[:0], w, split, valid)
    with pytest.raises(ValueError, match="need 0 < valid <= split < rows of packed"):
        fg.front_gemm(x, w, valid - 1, valid)
    with pytest.raises(ValueError, match="split must be a static int"):
        fg.front_gemm(x, w, 112.0, valid)
    with pytest.raises(ValueError, match=r"must be a multiple of block=32"):
        fg.front_gemm_plan(x, w, split + 8, valid)
    with pytest.raises(ValueError, match="block must be a power of two"):
        fg.front_gemm_plan(x, w, split, valid, block=24)
    with pytest.raises(ValueError, match="needs hidden divisible by split_k"):
        fg.front_gemm(x, w, split, valid, config=Grid(32, 64, 2, 4, 3))
    with pytest.raises(ValueError, match="GridConfig.block_rows must be a power of two"):
        Grid(24, 64, 1, 4, 3)
    with pytest.raises(NotImplementedError, match="B <= 256 .* backend='xla'"):
        fg.front_gemm(jnp.zeros((257, 64), jnp.bfloat16), w, split, valid)
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        fg.front_gemm(x[:, :40], w[:, :40], split, valid)


# --- on the GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_vector_schedule_matches_float64(tp):
    """The vector schedule at the batches it covers, to the same bounds as the tensor-core ones."""
    cfg = K3.with_tp(tp)
    params = mf.pack_params(k3_weights(shared=False), cfg)
    valid, split = cfg.experts_per_rank, params.split
    config = Vec(4 if tp == 8 else 16, 512, 4)
    for batch in (1, 3, 8):
        x = jax.random.normal(jax.random.key(batch), (batch, K3.hidden)).astype(jnp.bfloat16)
        logits, latent = jax.jit(lambda x, w: fg.front_gemm(x, w, split, valid, config=config))(
            x, params.packed)
        y = product(x, params.packed)
        mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
        assert (np.abs(np.asarray(logits, np.float64) - y[:, :valid]) <= 1e-5 * mag[:, :valid]).all()
        err = np.abs(np.asarray(latent.astype(jnp.float32), np.float64) - y[:, split:])
        assert (err <= oracle.bf16_ulp(mag[:, split:])).all(), (tp, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [0, 132, 264])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gpu_matches_float64(tp, programs):
    """Logits within 1e-5 and the latent within one bfloat16 ulp of a float64 product, relative to
    each value's magnitude measured at least at its row's RMS (fp32 accumulation cannot give entries
    near zero a relative bound); on small-integer data the outputs are exact. The plan from the
    epilogue is bit-equal to the reference's plan of the same latent, computed on the GPU. The
    tuned schedule (``programs=0``), or stream-K over 132 programs (runs as long as a whole tile)
    or 264."""
    cfg = K3.with_tp(tp)
    params = mf.pack_params(k3_weights(shared=False), cfg)
    valid, split = cfg.experts_per_rank, params.split
    for batch in (1, 7, 64, 256):
        x = jax.random.normal(jax.random.key(batch), (batch, K3.hidden)).astype(jnp.bfloat16)
        config = SK(32 if batch <= 64 else 64, 128 if batch <= 64 else 64, 4, 4,
                    programs) if programs else None
        gemm = jax.jit(lambda x, w: fg.front_gemm(x, w, split, valid, config=config))
        logits, latent = gemm(x, params.packed)
        y = product(x, params.packed)
        rms = np.sqrt((y**2).mean(axis=1, keepdims=True))
        mag = np.maximum(np.abs(y), rms)
        assert (np.abs(np.asarray(logits, np.float64) - y[:, :valid]) <= 1e-5 * mag[:, :valid]).all()
        err = np.abs(np.asarray(latent.astype(jnp.float32), np.float64) - y[:, split:])
        assert (err <= oracle.bf16_ulp(mag[:, split:])).all(), (tp, batch, (err / oracle.bf16_ulp(mag[:, split:])).max())

        xe, we = exact_front(batch, seed=tp, hidden=K3.hidden, valid=valid, split=split,
                             shard=cfg.latent_per_rank)
        logits, latent = gemm(xe, we)
        ye = product(xe, we)
        np.testing.assert_array_equal(np.asarray(logits), ye[:, :valid].astype(np.float32))
        np.testing.assert_array_equal(
            np.asarray(latent).view(np.uint16),
            ye[:, split:].astype(ml_dtypes.bfloat16).view(np.uint16),
        )

        planned = jax.jit(lambda x, w: fg.front_gemm_plan(x, w, split, valid, config=config))
        for data in ((x, params.packed), (xe, we)):
            _, latent, plan = planned(*data)
            want = jax.jit(reference.mxfp8_plan)(latent)
            for got, ref in zip(plan_bytes(plan), plan_bytes(want)):
                np.testing.assert_array_equal(got, ref)
