"""The Pallas MXFP8 plan kernel: interpret mode against the reference and the float64 oracle on the
SPEC's edge cases and random latents, lowering for an H200 from the CPU host, the mailbox and
tensor-parallel paths of ``moe_front`` through it, and on a GPU against the reference on the device."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

import moe_front_jax as mf
import moe_front_jax.pallas.plan as plan_stage
from moe_front_jax import registry, reference
from moe_front_jax.pallas.plan import kernel as pp
from bitwise import plan_bytes
from h200 import H200, lower_for_h200
import oracle
from plan_cases import edge_latent

BF16 = ml_dtypes.bfloat16
K3 = mf.KIMI_K3


@functools.partial(jax.jit, static_argnames=("block", "config"))
def interpret(latent, *, block=32, config=None):
    return pp.plan(latent, block, interpret=True, config=config)


reference_plan = jax.jit(reference.mxfp8_plan, static_argnums=1)


def assert_values_match_oracle(values, want):
    """Bytes equal, except that a NaN need only be a NaN (the SPEC names no NaN encoding)."""
    got_nan = np.isnan(values.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    want_nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan)
    np.testing.assert_array_equal(np.where(got_nan, 0, values), np.where(want_nan, 0, want.view(np.uint8)))


def check(latent, block=32, config=None):
    """The interpret kernel's bytes equal the reference's (NaN included: both run XLA's CPU ops) and
    the float64 oracle's; returns (values, scales) as uint8."""
    latent = jnp.asarray(latent, jnp.bfloat16)
    values, scales = interpret(latent, block=block, config=config)
    batch, width = latent.shape
    assert values.dtype == jnp.float8_e4m3fn and values.shape == (batch, width)
    assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (batch, width // block)
    got = plan_bytes((values, scales))
    for a, b in zip(got, plan_bytes(reference_plan(latent, block))):
        np.testing.assert_array_equal(a, b)
    want_values, want_scales = oracle.mxfp8_plan(np.asarray(latent), block)
    np.testing.assert_array_equal(got[1], want_scales)
    assert_values_match_oracle(got[0], want_values)
    return got


# --- SPEC edge cases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [32, 64, 448])
def test_edge_cases(width):
    latent, want_bytes = edge_latent(width)
    values, scales = check(latent)
    n = len(want_bytes)
    np.testing.assert_array_equal(scales.reshape(-1)[:n], want_bytes)
    v = values.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1, 32)
    raw = values.reshape(-1, 32)
    assert (raw[0] == 0x00).all() and (raw[1] == 0x80).all()  # zeros stay +0, -0 stays -0
    np.testing.assert_array_equal(raw[2, :3], [0x80, 0x00, 0x80])
    np.testing.assert_array_equal(raw[3, :3], [0x00, 0x80, 0x00])
    np.testing.assert_array_equal(v[4, :3], [448, -448, 1])
    np.testing.assert_array_equal(v[5, :2], [224, -1.5])
    np.testing.assert_array_equal(v[6, :4], [448, 224, 256, -224])
    np.testing.assert_array_equal(v[7, :4], [448, 1.0, 1.25, -1.0])
    np.testing.assert_array_equal(raw[8, 1:5], [0x00, 0x02, 0x00, 0x80])  # 2**-8 is subnormal 2
    np.testing.assert_array_equal(v[9, 1:4], [2.0**-9, 7 * 2.0**-9, 2.0**-6 * 1.875])
    np.testing.assert_array_equal(v[10, :3], [256, 128, -64])
    np.testing.assert_array_equal(v[11, :2], [448, 256])
    np.testing.assert_array_equal(v[12, :2], [224, 128])
    np.testing.assert_array_equal(raw[16, :3], [0x7E, 0x00, 0x80])  # 448; +-1 * 2**-127 -> +-0
    np.testing.assert_array_equal(v[17, :3], [-448, 448, 0])
    assert np.isnan(v[18, 0]) and v[18, 1] == 0 and v[18, 2] == 0 and np.isnan(v[19, 1])
    np.testing.assert_array_equal(v[20, :2], [448, -1])


def test_edge_cases_with_other_blocks_and_schedules():
    latent, _ = edge_latent(64)
    for block in (1, 2, 8, 16, 32, 64):
        check(latent, block)
    # Several segments a program, with a ragged last program (rows masked), and narrow segments.
    for config in (pp.PlanConfig(32, 4, 1), pp.PlanConfig(64, 8, 2), pp.PlanConfig(32, 1, 1)):
        check(latent, 32, config)


def test_every_bfloat16_pattern():
    """All 65536 bfloat16 bit patterns, shuffled into blocks (NaNs, infinities, subnormals, -0)."""
    patterns = np.random.default_rng(1).permutation(1 << 16).astype(np.uint16)
    check(patterns.view(BF16).reshape(64, 1024))


# --- random latents, shapes, schedules ---------------------------------------------------------------


def random_latent(batch, width, seed):
    """Normals scaled by a power of two per block, from 2**-40 to 2**40: scales differ block to block."""
    rng = np.random.default_rng(seed)
    blocks = width // 32
    scale = np.exp2(rng.integers(-40, 41, (batch, blocks))).repeat(32, axis=1)
    return (rng.normal(0, 1, (batch, width)) * scale).astype(BF16)


@pytest.mark.parametrize("width", [3584, 448, 96])
@pytest.mark.parametrize("batch", [1, 3, 37, 256])
def test_random_latents(batch, width):
    check(random_latent(batch, width, seed=batch * 7 + width))


@pytest.mark.parametrize("config", [pp.PlanConfig(32, 1, 1), pp.PlanConfig(64, 16, 4),
                                    pp.PlanConfig(512, 2, 4), pp.PlanConfig(128, 64, 8)])
def test_random_latents_under_every_schedule(config):
    check(random_latent(37, 3584, seed=5), 32, config)


def test_heuristic_schedule():
    """The widest segment dividing L; one segment a program at B=1; every SM busy at B=256."""
    assert pp.widest_segment(3584, 32) == 512 and pp.widest_segment(448, 32) == 64
    assert pp.widest_segment(96, 32) == 32 and pp.widest_segment(34, 2) == 2
    for latent in (3584, 1792, 896, 448):
        width = pp.widest_segment(latent, 32)
        one = pp.heuristic_config(1, latent, 32, cores=132)
        assert one.block_rows == 1 and one.width == width
        big = pp.heuristic_config(256, latent, 32, cores=132)
        segments = 256 * latent // width
        assert -(-segments // big.block_rows) >= 132
        assert big.block_rows * big.width <= pp.MAX_TILE and 1 <= big.num_warps <= 8
    assert pp.plan_bytes(256, 3584, 32) == 256 * 3584 * 3 + 256 * 112


# --- registration, lowering, errors ------------------------------------------------------------------


def test_registered_behind_the_plan_stage(monkeypatch):
    stage = registry.STAGES["plan"]
    assert stage.kernel == "moe_front_jax.pallas.plan:plan"
    assert stage.reference == "moe_front_jax.reference.plan:mxfp8_plan"
    assert stage.auto == registry.ALWAYS and stage.interprets
    latent = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)
    choice = registry.choose("plan", "interpret", latent, 32)
    assert choice.kernel and choice.run.keywords == {"interpret": True}
    assert not registry.choose("plan", "xla", latent, 32).kernel
    assert not registry.choose("plan", "auto", latent, 32).kernel  # no GPU here
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    choice = registry.choose("plan", "pallas", latent, 32)
    assert choice.kernel and choice.run.keywords == {"interpret": False}
    assert registry.choose("plan", "auto", latent, 32).kernel
    assert not registry.choose("plan", "xla", latent, 32).kernel


@pytest.fixture
def plan_spy(spy):
    """Counts the plan kernel's calls (through ``registry``, which loads the stage package's ``plan``,
    or straight to the kernel module's)."""
    calls = spy("plan", pp, plan_stage)
    registry.load.cache_clear()
    yield calls
    registry.load.cache_clear()


def small_front(cfg):
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg, shared=False), cfg)
    x = (jax.random.normal(jax.random.key(1), (5, cfg.hidden)) * 4).astype(jnp.bfloat16)
    return x, params


@pytest.mark.parametrize("plan_block", [32, 2])
def test_moe_front_mailbox_path_plans_in_the_collecting_kernel(plan_spy, plan_block):
    """With a mailbox the plan is of the collected latent, written by the routing kernel that
    collects it (``route_collect``, interpret mode): the standalone plan kernel does not run."""
    cfg = mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=64, shared=0, plan_block=plan_block)
    x, params = small_front(cfg)
    box = mf.Mailbox.create(cfg, capacity=8)
    step = jax.jit(
        functools.partial(mf.moe_front, plan=True, backend="interpret"), donate_argnames="mailbox"
    )
    out, box = step(x, params, mailbox=box)
    assert int(out.status) == 0 and plan_spy == []
    direct = mf.moe_front(x, params, backend="xla")
    np.testing.assert_array_equal(np.asarray(out.ids), np.asarray(direct.ids))
    for got, want in zip(plan_bytes(out.plan), plan_bytes(reference_plan(out.latent, plan_block))):
        np.testing.assert_array_equal(got, want)


def test_moe_front_under_tensor_parallelism_plans_with_the_kernel(plan_spy):
    """Under shard_map each rank plans the gathered latent with the kernel (interpret mode)."""
    cfg = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=256, shared=0)
    weights = mf.init_weights(jax.random.key(0), cfg, shared=False)
    params = mf.shard_params(weights, cfg, Mesh(np.array(jax.devices("cpu")[:4]), ("tp",)))
    x = (jax.random.normal(jax.random.key(1), (6, cfg.hidden)) * 4).astype(jnp.bfloat16)
    out = jax.jit(functools.partial(mf.moe_front, plan=True, backend="interpret"))(x, params)
    assert len(plan_spy) == 1  # traced once, run on every rank
    for got, want in zip(plan_bytes(out.plan), plan_bytes(reference_plan(out.latent, 32))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("latent", [3584, 448])
def test_lowers_for_h200_as_one_kernel(latent):
    """One Triton kernel per call; around it only free reshapes and the E8M0 bitcast."""
    for batch in (1, 8, 64, 256):
        text = lower_for_h200(lambda v: pp.plan(v), jnp.zeros((batch, latent), jnp.bfloat16))
        assert text.count("__gpu$xla.gpu.triton") == 1
        ops = set(op for op in text.split() if op.startswith("stablehlo.") and "(" not in op)
        ops = {op.split("(")[0] for op in ops}
        assert ops <= {"stablehlo.custom_call", "stablehlo.reshape", "stablehlo.bitcast_convert",
                       "stablehlo.mesh"}, (batch, ops)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        assert pp.pick_config(256, latent, 32) == pp.heuristic_config(256, latent, 32, H200.num_cores)


def test_errors():
    latent = jnp.zeros((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"latent must be a 2-D bfloat16 array \[B, L\], got \(2, 64\) float32"):
        pp.plan(latent.astype(jnp.float32))
    with pytest.raises(ValueError, match="latent must be a 2-D bfloat16"):
        pp.plan(latent[0])
    with pytest.raises(ValueError, match="latent is an empty batch"):
        pp.plan(latent[:0])
    with pytest.raises(ValueError, match="block must be a power of two >= 1, got 24"):
        pp.plan(latent, 24)
    with pytest.raises(ValueError, match="latent's width L=48 must be a multiple of block=32"):
        pp.plan(latent[:, :48])
    with pytest.raises(ValueError, match="config.width=16 must be a multiple of block=32"):
        pp.plan(latent, config=pp.PlanConfig(16, 1, 1))
    with pytest.raises(ValueError, match="config must be a PlanConfig"):
        pp.plan(latent, config=(64, 1, 1))
    with pytest.raises(ValueError, match="PlanConfig.block_rows must be a power of two"):
        pp.PlanConfig(64, 3, 1)


# --- on the GPU --------------------------------------------------------------------------------------

GPU_ROWS = 12_288


@pytest.mark.gpu
@pytest.mark.parametrize("latent", [3584, 448])
def test_gpu_matches_reference(latent):
    """12,288 random rows (normals over 81 binades, and random bfloat16 bit patterns: NaN, infinities,
    subnormals, -0) plus the edge rows, at the shipped schedule of each batch: scale bytes equal to
    the XLA reference's on the same device, value bytes equal except that a NaN need only be a NaN
    (the SPEC names no NaN encoding), and both equal the float64 oracle's."""
    kernel = jax.jit(pp.plan)
    rng = np.random.default_rng(latent)
    edges = np.resize(edge_latent(latent)[0].reshape(-1), (8, latent)).astype(BF16)
    batches = [edges] + [
        random_latent(256, latent, seed=i) if i % 2 else
        rng.integers(0, 1 << 16, (256, latent), dtype=np.uint16).view(BF16)
        for i in range(GPU_ROWS // 256)
    ]
    batches += [random_latent(b, latent, seed=b) for b in (1, 8, 64)]
    for latent_rows in batches:
        got = plan_bytes(kernel(jnp.asarray(latent_rows)))
        want = plan_bytes(reference_plan(jnp.asarray(latent_rows), 32))
        np.testing.assert_array_equal(got[1], want[1])
        assert_values_match_oracle(got[0], want[0].view(ml_dtypes.float8_e4m3fn))
        oracle_values, oracle_scales = oracle.mxfp8_plan(latent_rows)
        np.testing.assert_array_equal(got[1], oracle_scales)
        assert_values_match_oracle(got[0], oracle_values)
