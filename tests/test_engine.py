"""The streaming engine (``moe_front_jax.pallas.engine``): interpret mode against exact float64
products and the reference for every region mix (front; front with gate/up; down in bfloat16 and
float32), the edge batches, ``covers``' errors, the heuristic's tiling at Kimi-K3's shapes, lowering
for an H200 from the CPU host, and on a GPU against float64; ``moe_front``'s merged path (the
``front_gate_up`` and ``shared_down`` stages) against the reference, and its kernels on an H200."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference, registry
from moe_front_jax.params import padded_split
from moe_front_jax.pallas.engine import kernel as ek
from moe_front_jax.pallas.gemm import mosaic
from moe_front_jax.pallas.engine.kernel import EngineConfig
from bitwise import bits, plan_bytes
from engine_cases import (HIDDEN, K3, S_R, SHARD, SMALL, SPLIT, VALID, assert_front_exact,
                          close_to_float64, exact_front, exact_gate_up, exact_rows, k3_arrays,
                          product, situ_of)
from h200 import lower_for_h200
from kimi_k3 import k3_weights
import oracle

BATCHES = (1, 3, 8, 37, 64)


@functools.partial(jax.jit, static_argnames=("config",))
def front_interpret(x, w, *, config=None):
    """The merged front's logits and latent (its gate/up rows zero)."""
    gate_up = jnp.zeros((2 * S_R, x.shape[1]), jnp.bfloat16)
    return ek.front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL, config=config, interpret=True)[:2]


@functools.partial(jax.jit, static_argnames=("plan", "config"))
def gate_up_interpret(x, w, gate_up, *, plan=False, config=None):
    return ek.front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL, plan=plan, config=config,
                            interpret=True)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def down_interpret(hidden, down, *, out_dtype, config=None):
    return ek.down(hidden, down, out_dtype, config=config, interpret=True)


# --- interpret mode ----------------------------------------------------------------------------------

# Configs: the heuristic's; 4 logits chains of 16-column slices (fold_k 64 of K 256) with 8-row
# router CTAs; 2-stage rings of 128 columns with 32-row CTAs, x not padded to 64 rows (its TMA box
# runs past them).
FRONT_CONFIGS = (
    None,
    EngineConfig(router_rows=8, latent_rows=16, gate_up_rows=16, block_k=64, num_stages=3,
                 fold_k=64),
    EngineConfig(router_rows=32, latent_rows=64, gate_up_rows=32, block_k=128, num_stages=2),
)


@pytest.mark.parametrize("config", FRONT_CONFIGS)
@pytest.mark.parametrize("batch", BATCHES)
def test_interpret_front_gemm_is_exact(batch, config):
    """On exact data the logits equal the float64 product and the latent its bfloat16 rounding, at
    every batch (B = 3 and 37 not multiples of 8; 37 padded to 40 for the TMA copy)."""
    x, w = exact_front(batch, seed=batch)
    logits, latent = front_interpret(x, w, config=config)
    assert logits.shape == (batch, VALID) and logits.dtype == jnp.float32
    assert latent.shape == (batch, SHARD) and latent.dtype == jnp.bfloat16
    assert_front_exact(logits, latent, product(x, w))
    want_logits, want_latent = reference.front_gemm(x, w, SPLIT, VALID)
    np.testing.assert_array_equal(bits(latent), bits(want_latent))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want_logits))


def test_interpret_front_gemm_never_reads_the_padding():
    """NaN in the zero rows between valid and split changes nothing: no CTA reads them."""
    x, w = exact_front(8, seed=5, pad=np.nan)
    logits, latent = front_interpret(x, w)
    y = product(*exact_front(8, seed=5))
    assert_front_exact(logits, latent, y)


def test_interpret_front_gemm_random_data_within_contract():
    """Random data: logits within 1e-5 of the float64 product relative to each value's magnitude
    (at least its row's RMS), the latent within one bfloat16 ulp, with the logits' chains cut."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, HIDDEN)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((SPLIT + SHARD, HIDDEN)), jnp.bfloat16)
    logits, latent = front_interpret(x, w, config=FRONT_CONFIGS[1])
    y = product(x, w)
    mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
    assert (np.abs(np.asarray(logits, np.float64) - y[:, :VALID]) <= 1e-5 * mag[:, :VALID]).all()
    err = np.abs(np.asarray(latent.astype(jnp.float32), np.float64) - y[:, SPLIT:])
    assert (err <= oracle.bf16_ulp(mag[:, SPLIT:])).all()


GATE_UP_CONFIGS = (
    None,
    EngineConfig(router_rows=16, latent_rows=64, gate_up_rows=16, block_k=64, num_stages=3,
                 fold_k=128),
)


@pytest.mark.parametrize("plan", [False, True])
@pytest.mark.parametrize("config", GATE_UP_CONFIGS)
@pytest.mark.parametrize("batch", BATCHES)
def test_interpret_front_gate_up_is_exact(batch, config, plan):
    """The merged front, one launch over [router; latent; gate; up]: logits and latent exact,
    ``hidden`` bit-equal to ``reference.situ`` of the bfloat16-rounded exact gate and up, and the
    plan from the latent's epilogue bit-equal to ``reference.mxfp8_plan`` of the latent (blocks
    of 32 over 2 or 4 scale columns a CTA; the latent spans 2**-12 to 2**12)."""
    x, w = exact_front(batch, seed=batch)
    gate_up = exact_gate_up(S_R, seed=batch + 1)
    logits, latent, planned, hidden = gate_up_interpret(x, w, gate_up, plan=plan, config=config)
    assert hidden.shape == (batch, S_R) and hidden.dtype == jnp.bfloat16
    assert_front_exact(logits, latent, product(x, w))
    want = situ_of(product(x, gate_up), S_R)
    np.testing.assert_array_equal(bits(hidden), bits(want))
    assert np.abs(np.asarray(hidden, np.float32)).max() > 1  # not a vacuous all-small output
    if not plan:
        assert planned is None
        return
    values, scales = planned
    assert values.shape == (batch, SHARD) and values.dtype == jnp.float8_e4m3fn
    assert scales.shape == (batch, SHARD // 32) and scales.dtype == jnp.float8_e8m0fnu
    for got, ref in zip(plan_bytes(planned), plan_bytes(reference.mxfp8_plan(latent))):
        np.testing.assert_array_equal(got, ref)
    assert len(np.unique(plan_bytes(planned)[1])) > 1  # scales differ block to block


def test_interpret_plan_of_non_finite_latent():
    """Latent columns of infinity and NaN (an infinite weight row against x with zeros): the plan
    still equals the reference's, whose scale byte is 254 for such blocks."""
    x, w = exact_front(8, seed=7)
    w = w.at[SPLIT + 3].set(jnp.inf).at[SPLIT + 70, :5].set(jnp.nan)
    _, latent, planned, _ = gate_up_interpret(x, w, exact_gate_up(S_R), plan=True)
    values, scales = plan_bytes(planned)
    want_values, want_scales = plan_bytes(reference.mxfp8_plan(latent))
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(values, want_values)
    assert (want_scales[:, 0] == 254).all() and (want_scales[:, 2] == 254).all()


DOWN_CONFIGS = (None, EngineConfig(down_rows=64, block_k=32, num_stages=2))


@pytest.mark.parametrize("config", DOWN_CONFIGS)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("batch", (1, 37, 64))
def test_interpret_down_is_exact(batch, out_dtype, config):
    """``hidden @ down.T`` in bfloat16 (rounded once) or float32 (the tp partial), exact data."""
    rng = np.random.default_rng(batch)
    hidden = jnp.asarray(rng.integers(-3, 4, (batch, S_R)), jnp.bfloat16)
    down = jnp.asarray(exact_rows(rng, HIDDEN, S_R, -12, 12), jnp.bfloat16)
    out = down_interpret(hidden, down, out_dtype=out_dtype, config=config)
    assert out.shape == (batch, HIDDEN) and out.dtype == out_dtype
    want = product(hidden, down).astype(np.float32).astype(out_dtype)
    np.testing.assert_array_equal(bits(out), bits(jnp.asarray(want)))


K3_TP8_INTERPRET = EngineConfig(router_rows=56, latent_rows=64, gate_up_rows=64, block_k=256,
                                num_stages=2)


def test_interpret_k3_tp8_front_gate_up():
    """One rank at K3's tp8 shapes (560 front rows, 768 gate/up pairs, K = 7168: the logits in 4
    chains) with the plan, B = 3, on 21 CTAs in K steps of 256 (the heuristic's 131 CTAs in steps
    of 128 take over a minute here): exact against float64, the plan the reference's."""
    cfg = K3.with_tp(8)
    valid, shard, s_r = cfg.experts_per_rank, cfg.latent_per_rank, cfg.shared_per_rank
    split = padded_split(valid)
    x, w = exact_front(3, hidden=K3.hidden, valid=valid, split=split, shard=shard)
    gate_up = exact_gate_up(s_r, hidden=K3.hidden)
    logits, latent, planned, hidden = jax.jit(
        lambda x, w, g: ek.front_gate_up(x, w, split, valid, g, cfg, plan=True, interpret=True,
                                         config=K3_TP8_INTERPRET))(x, w, gate_up)
    assert_front_exact(logits, latent, product(x, w), valid, split)
    want = reference.situ(*(jnp.asarray(h.astype(ml_dtypes.bfloat16)) for h in
                            np.split(product(x, gate_up), 2, axis=1)), cfg.situ_beta,
                          cfg.linear_beta)
    np.testing.assert_array_equal(bits(hidden), bits(want))
    for got, ref in zip(plan_bytes(planned), plan_bytes(reference.mxfp8_plan(latent))):
        np.testing.assert_array_equal(got, ref)


# --- covers, configs and the heuristic ---------------------------------------------------------------


def test_covers_errors():
    x, w = exact_front(4)
    gate_up = exact_gate_up(S_R)
    h, d = x[:, :S_R], jnp.zeros((HIDDEN, S_R), jnp.bfloat16)
    ek.covers_front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL)
    ek.covers_down(h, d)
    big = jnp.zeros((65, HIDDEN), jnp.bfloat16)
    for call in (lambda: ek.front_gate_up(big, w, SPLIT, VALID, gate_up, SMALL),
                 lambda: ek.down(big[:, :S_R], d)):
        with pytest.raises(NotImplementedError, match="B <= 64 .* got B=65"):
            call()
    with pytest.raises(NotImplementedError, match="router rows into CTAs of 24 rows: 64 rows"):
        ek.covers_front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL,
                                config=EngineConfig(router_rows=24))
    with pytest.raises(NotImplementedError, match="latent rows into CTAs of 48 rows: 128 rows"):
        ek.front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL,
                         config=EngineConfig(router_rows=16, latent_rows=48))
    with pytest.raises(NotImplementedError, match="gate/up rows into CTAs of 48 rows: 64 rows"):
        ek.covers_front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL,
                                config=EngineConfig(router_rows=16, gate_up_rows=48))
    with pytest.raises(NotImplementedError, match="down rows into CTAs of 56 rows: 256 rows"):
        ek.covers_down(h, d, config=EngineConfig(down_rows=56, block_k=64))
    with pytest.raises(NotImplementedError, match="none divides 60"):
        ek.covers_front_gate_up(x, w[4:], SPLIT - 4, VALID - 4, gate_up, SMALL)  # 60 router rows
    with pytest.raises(NotImplementedError, match="multiple of 32"):
        ek.covers_front_gate_up(x[:, :48], w[:, :48], SPLIT, VALID, gate_up[:, :48], SMALL)
    with pytest.raises(NotImplementedError, match="latent_rows=16 is not a multiple of 32"):
        ek.covers_front_gate_up(
            x, w, SPLIT, VALID, gate_up, SMALL, plan=True,
            config=EngineConfig(router_rows=16, latent_rows=16, gate_up_rows=16))
    with pytest.raises(ValueError, match="latent shard's 120 rows must be a multiple of"):
        ek.covers_front_gate_up(x, w[:-8], SPLIT, VALID, gate_up, SMALL, plan=True)
    with pytest.raises(ValueError, match="x is an empty batch"):
        ek.front_gate_up(x[:0], w, SPLIT, VALID, gate_up, SMALL)
    with pytest.raises(ValueError, match="x must be a 2-D bfloat16 array"):
        ek.front_gate_up(x.astype(jnp.float32), w, SPLIT, VALID, gate_up, SMALL)
    with pytest.raises(ValueError, match="packed must have x's width 256, got 128"):
        ek.front_gate_up(x, w[:, :128], SPLIT, VALID, gate_up, SMALL)
    with pytest.raises(ValueError, match="need 0 < valid <= split <= rows of packed"):
        ek.front_gate_up(x, w, VALID - 8, VALID, gate_up, SMALL)
    with pytest.raises(ValueError, match="split must be a static int"):
        ek.front_gate_up(x, w, float(SPLIT), VALID, gate_up, SMALL)
    with pytest.raises(ValueError, match="gate_up must hold 2 S_r rows"):
        ek.front_gate_up(x, w, SPLIT, VALID, gate_up[:-1], SMALL)
    with pytest.raises(ValueError, match="gate_up must have x's width"):
        ek.front_gate_up(x, w, SPLIT, VALID, gate_up[:, :128], SMALL)
    with pytest.raises(ValueError, match="cfg must be a FrontConfig"):
        ek.front_gate_up(x, w, SPLIT, VALID, gate_up, None)
    with pytest.raises(ValueError, match="down must have hidden's width"):
        ek.down(x[:, :S_R], d[:, :32])
    with pytest.raises(ValueError, match="out_dtype must be bfloat16 or float32"):
        ek.down(h, d, jnp.float16)
    with pytest.raises(ValueError, match="needs hidden divisible by block_k=512"):
        ek.front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL,
                         config=EngineConfig(router_rows=16, block_k=512))
    with pytest.raises(ValueError, match="takes 256 KiB of shared memory, over the 227 KiB"):
        ek.front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL, config=EngineConfig(
            router_rows=64, latent_rows=64, gate_up_rows=32, block_k=256, num_stages=4))
    with pytest.raises(ValueError, match="8 accumulators of router_rows=64 take 256 registers"):
        ek.front_gate_up(jnp.zeros((1, 8192), jnp.bfloat16), jnp.zeros((SPLIT + SHARD, 8192),
                         jnp.bfloat16), SPLIT, VALID, jnp.zeros((2 * S_R, 8192), jnp.bfloat16),
                         SMALL, config=EngineConfig(router_rows=64, gate_up_rows=32, fold_k=1024))
    with pytest.raises(ValueError, match="config must be an EngineConfig or None"):
        ek.front_gate_up(x, w, SPLIT, VALID, gate_up, SMALL, config=(32, 32))


@pytest.mark.parametrize("field, value", [
    ("router_rows", 12), ("latent_rows", 264), ("gate_up_rows", 136), ("down_rows", 0),
    ("block_k", 96), ("block_k", 16), ("num_stages", 1), ("fold_k", 96), ("router_rows", 32.0),
])
def test_config_errors(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field} must be"):
        EngineConfig(**{field: value})


# (tp, region) -> (CTA rows, CTAs) of each region by the heuristic, whatever B (H200: 132 SMs).
K3_TILING = {
    (1, "front"): ((56, 16), (32, 112)),
    (1, "merged"): ((56, 16), (128, 28), (64, 96)),
    (8, "front"): ((16, 7), (16, 28)),
    (8, "merged"): ((16, 7), (16, 28), (8, 96)),
}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_heuristic_tiling_at_k3_shapes(tp):
    """Every region cut evenly, the accumulators within registers, the ring within shared memory;
    the merged front at most one wave and a bit (tp1: 140 CTAs whose 8 extra router CTAs follow
    the shortest ones) and tp8's 131 CTAs of 16 rows."""
    cfg = K3.with_tp(tp)
    valid, shard, s_r = cfg.experts_per_rank, cfg.latent_per_rank, cfg.shared_per_rank
    front = ek.heuristic_config(K3.hidden, router=valid, latent=shard)
    merged = ek.heuristic_config(K3.hidden, router=valid, latent=shard, gate_up=s_r)
    planned = ek.heuristic_config(K3.hidden, router=valid, latent=shard, gate_up=s_r,
                                  plan_block=32)
    assert planned.latent_rows % 32 == 0 and shard % planned.latent_rows == 0
    down = ek.heuristic_config(s_r, down=K3.hidden)
    for config, regions in ((front, ((valid, "router_rows"), (shard, "latent_rows"))),
                            (merged, ((valid, "router_rows"), (shard, "latent_rows"),
                                      (s_r, "gate_up_rows"))),
                            (down, ((K3.hidden, "down_rows"),))):
        stage = 2 * config.block_k * (64 + max(
            (2 if f == "gate_up_rows" else 1) * getattr(config, f) for _, f in regions))
        assert stage * config.num_stages <= ek.RING_SMEM
        for rows, field in regions:
            assert rows % getattr(config, field) == 0, (config, field)
    chains = ek.chains_for(K3.hidden, merged.fold_k, merged.block_k)
    assert chains * merged.router_rows <= 2 * ek.MAX_ACC_REGS
    assert 2 * merged.gate_up_rows <= 2 * ek.MAX_ACC_REGS
    if tp in (1, 8):
        got = {
            "front": ((front.router_rows, valid // front.router_rows),
                      (front.latent_rows, shard // front.latent_rows)),
            "merged": ((merged.router_rows, valid // merged.router_rows),
                       (merged.latent_rows, shard // merged.latent_rows),
                       (merged.gate_up_rows, s_r // merged.gate_up_rows)),
        }
        for kind, want in got.items():
            assert want == K3_TILING[tp, kind], (tp, kind)
        assert K3.hidden // down.down_rows == 128


def test_chains_cut_the_logits_accumulation():
    assert ek.chains_for(7168, 2048, 128) == 4
    assert ek.chains_for(2048, 2048, 128) == 1
    assert ek.chains_for(256, 64, 64) == 4
    assert ek.chains_for(7168, 2048, 32) == 2  # slices of 16 columns at least


# --- lowering for an H200 ----------------------------------------------------------------------------


def assert_one_engine_kernel(text, batch):
    assert text.count("@mosaic_gpu_v2") == 1 and "triton" not in text
    assert "stablehlo.dot_general" not in text
    assert text.count("mosaic_gpu.uses_pdl") == 1
    # One pad of x to a multiple of 8 rows (the TMA box), where B is not one.
    assert text.count("stablehlo.pad") == (1 if batch % 8 else 0)


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("batch", [1, 8, 37, 64])
def test_lowers_for_h200(tp, batch):
    """Each entry point at K3's shapes (the merged front with the plan and without) lowers for an
    H200 as one Mosaic GPU kernel launched with PDL, with no XLA dot beside it and at most one pad
    of ``x`` (to a multiple of 8 rows)."""
    cfg, valid, split, x, packed, gate_up, hidden, down = k3_arrays(tp, batch)
    for plan in (False, True):
        text = lower_for_h200(
            lambda x, w, g: ek.front_gate_up(x, w, split, valid, g, cfg, plan=plan),
            x, packed, gate_up)
        assert_one_engine_kernel(text, batch)
    for out_dtype in (jnp.bfloat16, jnp.float32):
        text = lower_for_h200(lambda h, d: ek.down(h, d, out_dtype), hidden, down)
        assert_one_engine_kernel(text, batch)


def test_lowers_without_pdl(monkeypatch):
    monkeypatch.setattr(mosaic, "LAUNCH_WITH_PDL", False)
    cfg, valid, split, x, packed, gate_up, *_ = k3_arrays(8, 8)
    text = lower_for_h200(lambda x, w, g: ek.front_gate_up(x, w, split, valid, g, cfg), x, packed,
                          gate_up)
    assert text.count("@mosaic_gpu_v2") == 1 and "mosaic_gpu.uses_pdl" not in text


# --- moe_front's merged path ------------------------------------------------------------------------


def small_params():
    return mf.init_weights(jax.random.key(5), SMALL, shared=True), SMALL


@pytest.mark.parametrize("batch", [1, 37, 64])
def test_moe_front_merged_meets_the_contract(batch):
    """With shared weights and ``"interpret"``, ``moe_front`` runs the merged stages. Against the
    ``"xla"`` reference: logits within float32 summation order, latent and shared output within one
    bfloat16 ulp (a float32 sum in another order may move a rounding); ids, weights and the
    dispatch are exactly the reference routing of the logits the call returned, the plan exactly
    the reference plan of its latent."""
    weights, cfg = small_params()
    params = mf.pack_params(weights, cfg)
    x = jax.random.normal(jax.random.key(batch), (batch, HIDDEN)).astype(jnp.bfloat16)
    assert mf.explain(x, params, plan=True, backend="interpret").merged
    assert not mf.explain(x, params, plan=True, backend="xla").merged
    assert not mf.explain(x, params, plan=True).merged  # "auto" keeps it off (registry)
    front = jax.jit(mf.moe_front, static_argnames=("plan", "permute", "backend"))
    want = front(x, params, plan=True, permute=True, backend="xla")
    got = front(x, params, plan=True, permute=True, backend="interpret")
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for field in ("latent", "shared"):
        assert oracle.bf16_ulp_distance(getattr(got, field), getattr(want, field)).max() <= 1
    ids, route_weights, *dispatch = reference.route(got.logits, params.bias, cfg, permute=True)
    for g, w in zip((got.ids, got.weights, *got.dispatch), (ids, route_weights, *dispatch)):
        np.testing.assert_array_equal(bits(g), bits(w))
    for g, w in zip(got.plan, reference.mxfp8_plan(got.latent, cfg.plan_block)):
        np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.parametrize("plan", [False, True])
def test_moe_front_merged_through_a_mailbox_keeps_the_direct_bits(plan):
    """Through a mailbox the merged front's logits and latent are published after it (its plan
    off, the collect's on; the same tiling, so the same sums): ids, weights, logits and latent
    equal the direct merged path's (-0 canonicalized to +0, which these rows do not hold), the
    plan is the reference's of the latent, the shared output is the same."""
    weights, cfg = small_params()
    params = mf.pack_params(weights, cfg)
    x = jax.random.normal(jax.random.key(11), (6, HIDDEN)).astype(jnp.bfloat16)
    assert mf.explain(x, params, backend="interpret", mailbox=True).merged
    front = jax.jit(mf.moe_front, static_argnames=("plan", "backend"))
    want = front(x, params, plan=plan, backend="interpret")
    got, _ = front(x, params, plan=plan, backend="interpret",
                   mailbox=mf.Mailbox.create(cfg, capacity=8))
    assert int(got.status) == 0
    for field in ("ids", "weights", "logits", "latent", "shared"):
        np.testing.assert_array_equal(bits(getattr(got, field)), bits(getattr(want, field)), field)
    assert (got.plan is None) == (not plan)
    if plan:
        for g, w in zip(got.plan, reference.mxfp8_plan(want.latent, cfg.plan_block)):
            np.testing.assert_array_equal(bits(g), bits(w))


def test_moe_front_under_tp_stays_unmerged():
    """One rank's front under tensor parallelism takes the separate stages (Mosaic GPU's interpret
    mode cannot run under a ``shard_map`` of several devices): the sharded path under
    ``"interpret"`` equals the reference."""
    weights, cfg = small_params()
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    params = mf.shard_params(weights, cfg.with_tp(2), mesh, "tp")
    x = jax.random.normal(jax.random.key(9), (5, HIDDEN)).astype(jnp.bfloat16)
    want = mf.moe_front(x, params, plan=True, backend="xla")
    got = mf.moe_front(x, params, plan=True, backend="interpret")
    for field in ("ids", "weights", "latent", "shared"):
        np.testing.assert_array_equal(bits(getattr(got, field)), bits(getattr(want, field)), field)


def test_moe_front_past_the_engine_takes_the_separate_stages():
    """B = 65 is past the engine's 64 rows: ``"interpret"`` runs the front GEMM and shared expert
    kernels instead, and the plan says why."""
    weights, cfg = small_params()
    params = mf.pack_params(weights, cfg)
    x = jax.ShapeDtypeStruct((65, HIDDEN), jnp.bfloat16)
    front = mf.explain(x, params, backend="interpret")
    assert not front.merged
    assert "B <= 64" in front.notes[0]
    assert [(s.stage, s.kernel) for s in front.steps] == [
        ("front_gemm", True), ("route", True), ("shared_expert", True)]
    with pytest.raises(NotImplementedError, match="B <= 64"):
        registry.choose("front_gate_up", "interpret", x, params.packed, params.split,
                        cfg.experts_per_rank, params.gate_up, cfg)


@pytest.mark.parametrize("batch, plan", [(1, True), (8, False), (64, True)])
def test_moe_front_merged_is_three_kernels_on_an_h200(batch, plan):
    """``moe_front(x, params, plan=...)`` with K3's shared weights under ``"pallas"`` lowers for an
    H200 as three kernels: the merged front and the down (Mosaic GPU, launched with PDL) and the
    routing kernel (Triton); no XLA dot. Where B is not a multiple of 8 XLA pads ``x`` and
    ``hidden`` to one (each launch's TMA box of them)."""
    params = mf.pack_params(k3_weights(), K3)
    x = jnp.zeros((batch, K3.hidden), jnp.bfloat16)
    text = lower_for_h200(lambda x, p: mf.moe_front(x, p, plan=plan, backend="pallas"), x, params)
    assert text.count("@mosaic_gpu_v2") == 2 and text.count("mosaic_gpu.uses_pdl") == 2
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "stablehlo.dot_general" not in text
    assert text.count("stablehlo.pad") == (2 if batch % 8 else 0)


def test_moe_front_without_a_latent_is_merged_on_an_h200():
    """DeepSeek-V3 (no latent, SiLU, grouped routing) under ``"pallas"`` lowers for an H200 with
    the merged front, the grouped routing and the down as its three Mosaic GPU kernels, no Triton
    kernel and no XLA dot or top-k."""
    cfg = mf.configs.DEEPSEEK_V3
    params = mf.pack_params(mf.init_weights(jax.random.key(1), cfg), cfg)
    x = jnp.zeros((8, cfg.hidden), jnp.bfloat16)
    text = lower_for_h200(lambda x, p: mf.moe_front(x, p, backend="pallas"), x, params)
    assert text.count("@mosaic_gpu_v2") == 3 and "triton" not in text
    assert "stablehlo.dot_general" not in text and "top_k" not in text


# --- on the GPU --------------------------------------------------------------------------------------


GATE_UP_RTOL = 4e-5
"""How far a float32 gate or up may lie from float64, relative to ``max(|y|, the row's RMS)``: one
tensor-core chain over K3's 7168 (not cut as the logits' is) was 1.8-2.4x the logits' 1e-5
(docs/findings.md, stream-K and the fold)."""


def roundings(y):
    """The bfloat16 roundings ``(low, high)`` of the ends of the interval within ``GATE_UP_RTOL``
    of float64 ``y`` (at ``max(|y|, the row's RMS)``): equal except near a rounding midpoint where
    ``|y|`` is near the RMS; where ``|y|`` is far below it the interval holds more bfloat16 values
    than its ends."""
    mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
    return tuple(jnp.asarray((y + sign * GATE_UP_RTOL * mag).astype(ml_dtypes.bfloat16))
                 for sign in (-1, 1))


def situ_distance(hidden, gate, up, cfg):
    """How far ``hidden`` lies, in bfloat16 ulps, from situ of the nearest pair of ``roundings``
    of the float64 ``gate`` and ``up``: 0 where it is situ of one of them. A measure, printed by
    the GPU test, not a bound."""
    hidden = jnp.asarray(hidden, jnp.bfloat16)
    distance = None
    for g in roundings(gate):
        for u in roundings(up):
            d = oracle.bf16_ulp_distance(hidden, reference.situ(g, u, cfg.situ_beta,
                                                                cfg.linear_beta))
            distance = d if distance is None else np.minimum(distance, d)
    return distance


def test_situ_distance_allows_either_rounding_only_near_a_midpoint():
    one_ulp = 2.0**-7  # bfloat16's ulp at 1
    gate = np.array([[1.0, 1.0 + one_ulp / 2, 1.0 + one_ulp / 4, -1.0 - one_ulp / 2 + 1e-6]])
    up = np.full_like(gate, 0.5)
    low, high = roundings(gate)
    assert (np.asarray(low) != np.asarray(high)).tolist() == [[False, True, False, True]]
    situ = functools.partial(reference.situ, beta=SMALL.situ_beta, linear_beta=SMALL.linear_beta)
    half = jnp.full(gate.shape, 0.5, jnp.bfloat16)
    for g in (low, high):  # either rounding of the midpoints is at distance 0
        assert (situ_distance(situ(g, half), gate, up, SMALL) == 0).all()
    # One ulp past the roundings is at distance 1 or more, at a midpoint and away from them (the
    # positive values: near -1 situ's bfloat16 output repeats from one input ulp to the next).
    past = jnp.asarray((np.asarray(high, np.float64) + one_ulp).astype(ml_dtypes.bfloat16))
    assert (situ_distance(situ(past, half), gate, up, SMALL)[:, :3] >= 1).all()
    # Two input ulps past are more than the GPU test's one output ulp off.
    past = jnp.asarray((np.asarray(high, np.float64) + 2 * one_ulp).astype(ml_dtypes.bfloat16))
    assert (situ_distance(situ(past, half), gate, up, SMALL)[:, :3] >= 2).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_front_matches_float64(tp):
    """Logits within 1e-5 of the float64 product, the latent within one bfloat16 ulp, from the
    merged front; the plan bit-equal to the reference's plan of the same
    latent on the same device; ``hidden`` through a down projection within 1e-2 of the float64
    shared expert; on exact data the logits, latent and plan exact and ``hidden`` within one ulp of
    the reference situ of the exact gate and up."""
    cfg = K3.with_tp(tp)
    params = mf.pack_params(k3_weights(), cfg)
    valid, split = cfg.experts_per_rank, params.split
    merged = jax.jit(lambda x, w, g: ek.front_gate_up(x, w, split, valid, g, cfg))
    planned_front = jax.jit(lambda x, w, g: ek.front_gate_up(x, w, split, valid, g, cfg, plan=True))
    for batch in (1, 7, 37, 64):
        x = jax.random.normal(jax.random.key(batch), (batch, K3.hidden)).astype(jnp.bfloat16)
        y = product(x, params.packed)
        logits, latent = merged(x, params.packed, params.gate_up)[:2]
        assert close_to_float64(logits, y[:, :valid], 1e-5), (tp, batch)
        err = np.abs(np.asarray(latent.astype(jnp.float32), np.float64) - y[:, split:])
        mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))[:, split:]
        assert (err <= oracle.bf16_ulp(mag)).all(), (tp, batch)
        _, latent, planned, _ = planned_front(x, params.packed, params.gate_up)
        want = jax.jit(reference.mxfp8_plan)(latent)  # the reference's plan on the same device
        for got, ref in zip(plan_bytes(planned), plan_bytes(want)):
            np.testing.assert_array_equal(got, ref)
        # hidden, through a down projection, within 1e-2 of the float64 shared expert (SPEC
        # section 6's bound; the separate shared-expert kernels meet the same). hidden itself is
        # not bit-level: one wgmma chain over K = 7168 moves gate's and up's bfloat16 roundings, and
        # situ magnifies a moved rounding where it is steep or near zero (an H100, 2026-12-07: 1.3%
        # of tp1 B=1's values were not situ of the roundings of a float32 sum GATE_UP_RTOL from
        # float64, at tp1 B=37 one was 1.2e-2 of its row's RMS off; docs/findings.md). How far
        # they part is printed (pytest -rP); exact data below stays within one ulp.
        hidden = merged(x, params.packed, params.gate_up)[3]
        gate, up = np.split(product(x, params.gate_up), 2, axis=1)
        distance = situ_distance(hidden, gate, up, cfg)
        want = reference.situ(*(jnp.asarray(g.astype(ml_dtypes.bfloat16)) for g in (gate, up)),
                              cfg.situ_beta, cfg.linear_beta)
        down = jax.random.normal(jax.random.key(tp), (K3.hidden, hidden.shape[1]))
        down = np.asarray(down.astype(jnp.bfloat16), np.float64)
        shared = np.asarray(want, np.float64) @ down.T
        print(f"tp{tp} B={batch}: {(distance > 0).sum()} of {distance.size} hidden values off situ, "
              f"{(distance > 1).sum()} by 2 ulps or more")
        assert close_to_float64(np.asarray(hidden, np.float64) @ down.T, shared, 1e-2), (tp, batch)

        xe, we = exact_front(batch, hidden=K3.hidden, valid=valid, split=split,
                             shard=cfg.latent_per_rank, seed=tp)
        ge = exact_gate_up(cfg.shared_per_rank, hidden=K3.hidden, seed=tp)
        logits, latent = merged(xe, we, ge)[:2]
        assert_front_exact(logits, latent, product(xe, we), valid, split)
        _, latent, planned, _ = planned_front(xe, we, ge)
        for got, ref in zip(plan_bytes(planned), plan_bytes(reference.mxfp8_plan(latent))):
            np.testing.assert_array_equal(got, ref)
        want = reference.situ(*(jnp.asarray(h.astype(ml_dtypes.bfloat16)) for h in
                                np.split(product(xe, ge), 2, axis=1)), cfg.situ_beta,
                              cfg.linear_beta)
        distance = oracle.bf16_ulp_distance(merged(xe, we, ge)[3], want)
        off = f"tp{tp} B={batch} exact data: {(distance > 0).sum()} of {distance.size} values off situ"
        print(off)
        assert (distance <= 1).all(), off


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_gpu_down_matches_float64(tp):
    """The down in bfloat16 within one ulp and the float32 partial within 1e-4 of float64 (its one
    accumulation chain over S_r is not cut as the logits' is: the SPEC bounds only the logits);
    exact data exact."""
    cfg = K3.with_tp(tp)
    params = mf.pack_params(k3_weights(), cfg)
    down32 = jax.jit(lambda h, d: ek.down(h, d, jnp.float32))
    down16 = jax.jit(lambda h, d: ek.down(h, d))
    for batch in (1, 8, 37, 64):
        hidden = jax.random.normal(jax.random.key(batch), (batch, cfg.shared_per_rank))
        hidden = hidden.astype(jnp.bfloat16)
        y = product(hidden, params.down)
        assert close_to_float64(down32(hidden, params.down), y, 1e-4), (tp, batch)
        mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
        err = np.abs(np.asarray(down16(hidden, params.down).astype(jnp.float32), np.float64) - y)
        assert (err <= oracle.bf16_ulp(mag)).all(), (tp, batch)

        rng = np.random.default_rng(batch)
        he = jnp.asarray(rng.integers(-3, 4, (batch, cfg.shared_per_rank)), jnp.bfloat16)
        de = jnp.asarray(exact_rows(rng, K3.hidden, cfg.shared_per_rank, -12, 12), jnp.bfloat16)
        ye = product(he, de)
        np.testing.assert_array_equal(np.asarray(down32(he, de)), ye.astype(np.float32))
        np.testing.assert_array_equal(bits(down16(he, de)),
                                      ye.astype(ml_dtypes.bfloat16).view(np.uint16))
