"""Tensor parallelism (moe_front_jax.parallel) on 8 virtual CPU devices (16 in a subprocess).

Expected values come from the unsharded reference stages on one device (``reference.*`` over
``pack_params(w, cfg)`` with tp=1), never from the sharded code.
"""

import dataclasses
import functools
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_front_jax as mf
from bitwise import plan_bytes, traced_bits
from h200 import H200
import oracle
from moe_front_jax import registry, parallel, reference
from moe_front_jax.params import BIAS, DOWN, GATE_UP, weight_shapes

CFG = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=128, shared=128)
CFG_NO_SHARED = mf.FrontConfig(hidden=256, experts=128, top_k=16, latent=256, shared=0)
ROWS = 6


def devices(n):
    """The first ``n`` CPU devices (on a GPU host too: these are the virtual devices of conftest)."""
    if len(jax.devices("cpu")) < n:
        pytest.fail(f"the sharded tests need {n} devices; conftest sets 8 virtual CPU devices")
    return jax.devices("cpu")[:n]


def tp_mesh(tp, names=("tp",), shape=None):
    shape = shape or (tp,)
    return Mesh(np.array(devices(int(np.prod(shape)))).reshape(shape), names)


@functools.cache
def weights(cfg):
    return mf.init_weights(jax.random.key(0), cfg)


@functools.cache
def rows(cfg, b=ROWS):
    return jax.random.normal(jax.random.key(1), (b, cfg.hidden), jnp.float32).astype(jnp.bfloat16)


@functools.cache
def unsharded(cfg, b=ROWS):
    """The reference front on one device: logits, latent, ids, weights, plan, shared (float32)."""

    @jax.jit
    def run(x, w):
        local = mf.pack_params(w, cfg)
        logits, latent = reference.front_gemm(x, local.packed, local.split, cfg.experts)
        ids, routing = reference.route(logits, local.bias, cfg)
        plan = reference.mxfp8_plan(latent, cfg.plan_block)
        shared = None
        if cfg.shared:
            shared = reference.shared_expert(x, w[GATE_UP], w[DOWN], cfg, jnp.float32)
        return dict(logits=logits, latent=latent, ids=ids, weights=routing, plan=plan, shared=shared)

    return run(rows(cfg, b), weights(cfg))


def zero_weights(cfg):
    """Weights of the right keys, shapes and dtypes, for the tests that must fail before using them."""
    return {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in weight_shapes(cfg).items()}


def front(x, params, **options):
    return jax.jit(functools.partial(mf.moe_front, **options))(x, params)


def assert_every_device_holds_the_same(out):
    """``np.asarray`` of a replicated output reads one device's copy; every device's must hold the
    same bits (out_specs=P() with check_vma=False takes each rank's result as it is)."""
    for name, field in zip(out._fields, out):
        for array in field if isinstance(field, tuple) else (field,):
            if array is None or not array.sharding.is_fully_replicated:
                continue
            copies = [np.asarray(s.data) for s in array.addressable_shards]
            bits = [c.view(f"u{c.dtype.itemsize}") for c in copies]
            for shard, b in zip(array.addressable_shards[1:], bits[1:]):
                np.testing.assert_array_equal(b, bits[0], err_msg=f"{name} on {shard.device}")


def assert_matches_unsharded(out, cfg, b=ROWS, plan=False):
    """ids, weights, latent and plan equal; logits to float32 rounding; shared within bf16 rounding;
    the same on every device."""
    assert_every_device_holds_the_same(out)
    expected = unsharded(cfg, b)
    np.testing.assert_array_equal(out.ids, expected["ids"])
    np.testing.assert_array_equal(out.weights, expected["weights"])
    np.testing.assert_array_equal(out.latent, expected["latent"])
    np.testing.assert_allclose(out.logits, expected["logits"], rtol=1e-6, atol=1e-6)
    assert (out.plan is not None) == plan
    if plan:
        for got, want in zip(plan_bytes(out.plan), plan_bytes(expected["plan"])):
            np.testing.assert_array_equal(got, want)
    if expected["shared"] is None:
        assert out.shared is None
        return
    got = np.asarray(out.shared, np.float32)
    want = np.asarray(expected["shared"], np.float32)
    # One rounding to bfloat16 (half an ulp, 2**-8 relative) of a float32 sum in another order.
    bound = 2.0**-8 * np.abs(want) + 2.0**-20 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()


def collectives(compiled_text):
    """Opcodes of the collectives in compiled HLO text, one entry per instruction."""
    ops = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    pattern = rf"= \S+ ({ops})(?:-start)?\("
    return re.findall(pattern, compiled_text)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shard_params_places_each_ranks_pack_params(tp):
    mesh = tp_mesh(tp)
    params = mf.shard_params(weights(CFG), CFG, mesh)
    assert params.cfg == CFG.with_tp(tp) and params.mesh is mesh and params.axis == "tp"
    for rank in range(tp):
        local = mf.pack_params(weights(CFG), CFG.with_tp(tp), rank=rank)
        assert params.split == local.split
        blocks = {
            "packed": (params.packed, 0, local.packed),
            "gate_up": (params.gate_up, 0, local.gate_up),
            "down": (params.down, 1, local.down),
        }
        for name, (array, dim, want) in blocks.items():
            size = want.shape[dim]
            index = [slice(None)] * 2
            index[dim] = slice(rank * size, (rank + 1) * size)
            np.testing.assert_array_equal(np.asarray(array)[tuple(index)], want, err_msg=name)
            # The device at index ``rank`` of the tp axis holds exactly that block.
            shard = next(s for s in array.addressable_shards if s.device == mesh.devices[rank])
            np.testing.assert_array_equal(np.asarray(shard.data), want, err_msg=name)
        np.testing.assert_array_equal(params.bias, local.bias)
    assert all(s.data.shape == (CFG.experts,) for s in params.bias.addressable_shards)


@pytest.mark.parametrize("shared_reduce", ["psum", "psum_scatter"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_sharded_front_matches_unsharded_reference(tp, shared_reduce):
    mesh = tp_mesh(tp)
    params = mf.shard_params(weights(CFG), CFG, mesh)
    out = front(rows(CFG), params, plan=True, backend="xla", shared_reduce=shared_reduce)
    assert_matches_unsharded(out, CFG, plan=True)
    assert out.shared.shape == (ROWS, CFG.hidden)
    if shared_reduce == "psum_scatter":
        # Each device holds its H/tp hidden columns of the reduce-scatter.
        width = CFG.hidden // tp
        for rank, device in enumerate(mesh.devices):
            shard = next(s for s in out.shared.addressable_shards if s.device == device)
            columns = np.arange(CFG.hidden)[shard.index[1]]
            np.testing.assert_array_equal(columns, np.arange(rank * width, (rank + 1) * width))


def test_non_finite_rows_route_to_distinct_ids_on_every_rank():
    """SPEC section 8 under tp=8: an all-NaN row and an all-inf row still give top_k distinct ids
    in range on every device (the NaN row its lowest ids), and the finite rows their reference's."""
    params = mf.shard_params(weights(CFG), CFG, tp_mesh(8))
    x = rows(CFG).at[0].set(jnp.nan).at[1].set(jnp.inf)
    out = front(x, params, backend="xla")
    assert_every_device_holds_the_same(out)
    ids = np.asarray(out.ids)
    oracle.assert_valid_ids(ids, CFG.experts)
    np.testing.assert_array_equal(ids[0], np.arange(CFG.top_k))
    np.testing.assert_array_equal(ids[2:], unsharded(CFG)["ids"][2:])


def test_sharded_front_without_shared_expert():
    params = mf.shard_params(weights(CFG_NO_SHARED), CFG_NO_SHARED, tp_mesh(8))
    assert params.gate_up is None and params.down is None
    assert_matches_unsharded(front(rows(CFG_NO_SHARED), params, backend="xla"), CFG_NO_SHARED)
    # Half the shared expert's pair is refused, not dropped.
    params = mf.shard_params(weights(CFG), CFG, tp_mesh(8))
    with pytest.raises(ValueError, match="params.down is given but params.gate_up is None"):
        front(rows(CFG), dataclasses.replace(params, gate_up=None), backend="xla")


@pytest.mark.parametrize(
    "cfg, shared_reduce, reduction",
    [(CFG_NO_SHARED, "psum", []), (CFG, "psum", ["all-reduce"]),
     (CFG, "psum_scatter", ["reduce-scatter"])],
)
def test_exchange_is_one_all_gather(cfg, shared_reduce, reduction):
    params = mf.shard_params(weights(cfg), cfg, tp_mesh(8))
    call = jax.jit(functools.partial(mf.moe_front, backend="xla", shared_reduce=shared_reduce))
    lowered = call.lower(rows(cfg), params)
    assert len(re.findall(r'"stablehlo\.all_gather"', lowered.as_text())) == 1
    assert sorted(collectives(lowered.compile().as_text())) == sorted(["all-gather"] + reduction)


def test_exchange_is_bit_exact():
    """Every bit pattern survives: NaN payloads, -0.0, infinities, subnormals, in rank order."""
    tp, b, valid, shard = 8, 3, 5, 7
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, (b, tp * valid), dtype=np.uint32)
    bits[0, :6] = [0x7FC00001, 0xFFFFFFFF, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001]
    logits = bits.view(np.float32)
    halves = rng.integers(0, 2**16, (b, tp * shard), dtype=np.uint16)
    halves[0, :3] = [0x8000, 0x7FC1, 0xFF80]
    latent = jnp.asarray(halves).view(jnp.bfloat16)

    gathered = jax.jit(
        jax.shard_map(
            functools.partial(parallel.exchange, axis_name="tp"),
            mesh=tp_mesh(tp),
            in_specs=(P(None, "tp"), P(None, "tp")),
            out_specs=(P(), P()),
        )
    )(jnp.asarray(logits), latent)
    np.testing.assert_array_equal(np.asarray(gathered[0]).view(np.uint32), bits)
    np.testing.assert_array_equal(np.asarray(gathered[1]).view(np.uint16), halves)


@pytest.mark.parametrize("shared_reduce", ["psum", "psum_scatter"])
def test_axis_name_inside_callers_shard_map(shared_reduce):
    mesh = tp_mesh(8)
    params = mf.shard_params(weights(CFG), CFG, mesh)
    specs = jax.tree.map(lambda a: a.sharding.spec, params)
    shared_spec = P(None, "tp") if shared_reduce == "psum_scatter" else P()

    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs), out_specs=mf.FrontOutput(
            P(), P(), P(), P(), shared_spec, P(), P())
    )
    def step(x, local):
        out = mf.moe_front(x, local, axis_name="tp", backend="xla", shared_reduce=shared_reduce)
        width = CFG.hidden // 8 if shared_reduce == "psum_scatter" else CFG.hidden
        assert out.shared.shape == (ROWS, width)
        return out

    assert_matches_unsharded(jax.jit(step)(rows(CFG), params), CFG)


@pytest.mark.parametrize(
    "shape, names, axis_type",
    [((2, 4), ("data", "tp"), AxisType.Explicit), ((4, 2), ("tp", "data"), AxisType.Auto)],
)
def test_data_axis_beside_tp_splits_the_batch(shape, names, axis_type):
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * 2, devices=devices(8))
    params = mf.shard_params(weights(CFG), CFG, mesh)
    x = jax.device_put(rows(CFG), jax.sharding.NamedSharding(mesh, P("data", None)))
    call = jax.jit(functools.partial(mf.moe_front, backend="xla", shared_reduce="psum_scatter"))
    out = call(x, params)
    assert_matches_unsharded(out, CFG)
    assert out.ids.sharding.spec == P("data", None)
    assert out.shared.sharding.spec == P("data", "tp")
    # Each data group exchanges within its own tp ranks: still one all-gather, no gather of x.
    assert sorted(collectives(call.lower(x, params).compile().as_text())) == [
        "all-gather", "reduce-scatter"]
    # x as the caller has it (one device, or split over tp) is resharded to the batch split.
    split_over_tp = jax.sharding.NamedSharding(mesh, P("tp"))
    for placed in (rows(CFG), jax.device_put(rows(CFG)[:4], split_over_tp)):
        np.testing.assert_array_equal(call(placed, params).ids, unsharded(CFG)["ids"][:len(placed)])
    with pytest.raises(ValueError, match=r"B=5 rows.*divisible by 2"):
        mf.moe_front(rows(CFG, 5), params)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (mf.FrontConfig(hidden=64, experts=64, top_k=8, latent=96, shared=96), "experts=64"),
        (mf.FrontConfig(hidden=64, experts=96, top_k=8, latent=128, shared=96), "latent=128"),
        (mf.FrontConfig(hidden=64, experts=96, top_k=8, latent=96, shared=64), "shared=64"),
    ],
)
def test_tp_not_dividing_a_size_is_refused(cfg, message):
    with pytest.raises(ValueError, match=rf"FrontConfig\.{message} must be divisible by the size 3"):
        mf.shard_params(zero_weights(cfg), cfg, tp_mesh(3))


def test_bad_meshes_and_axes_are_refused():
    w = weights(CFG)
    with pytest.raises(ValueError, match=r"axis='tp' is not an axis of the mesh"):
        mf.shard_params(w, CFG, tp_mesh(8, names=("data",)))
    with pytest.raises(ValueError, match=r"axis='model' is not an axis"):
        mf.shard_params(w, CFG, tp_mesh(8), axis="model")
    with pytest.raises(ValueError, match=r"cfg\.tp=4 disagrees with mesh axis 'tp' of size 8"):
        mf.shard_params(w, CFG.with_tp(4), tp_mesh(8))
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        mf.shard_params(w, CFG, "tp")
    with pytest.raises(ValueError, match="concrete jax.sharding.Mesh to place the weights on"):
        mf.shard_params(w, CFG, tp_mesh(8).abstract_mesh)
    for align in (2.5, True, 0):
        with pytest.raises(ValueError, match=f"split_align must be a positive int, got {align!r}"):
            mf.shard_params(w, CFG, tp_mesh(8), split_align=align)
    # A NumPy integer is taken as its int, as pack_params takes it.
    numpy_align = mf.shard_params(w, CFG, tp_mesh(8), split_align=np.int64(16))
    assert numpy_align.split == mf.shard_params(w, CFG, tp_mesh(8), split_align=16).split
    params = mf.shard_params(w, CFG.with_tp(8), tp_mesh(8))
    with pytest.raises(ValueError, match="shared_reduce must be one of"):
        mf.moe_front(rows(CFG), params, shared_reduce="sum")
    narrow = mf.FrontConfig(hidden=100, experts=64, top_k=8, latent=128, shared=128)
    with pytest.raises(ValueError, match=r"hidden=100 over tp=8"):
        mf.moe_front(rows(narrow), mf.shard_params(zero_weights(narrow), narrow, tp_mesh(8)),
                     shared_reduce="psum_scatter")


def test_axis_name_that_disagrees_with_params_is_refused():
    local = mf.pack_params(weights(CFG), CFG)
    with pytest.raises(ValueError, match=r"axis_name='tp' is not an axis of the enclosing"):
        mf.moe_front(rows(CFG), local, axis_name="tp")
    quarter = mf.pack_params(weights(CFG), CFG.with_tp(4))
    with pytest.raises(ValueError, match=r"axis_name='tp' has 8 devices .* tp=4"):
        jax.shard_map(
            lambda x: mf.moe_front(x, quarter, axis_name="tp").ids,
            mesh=tp_mesh(8), in_specs=P(), out_specs=P(),
        )(rows(CFG))


def assert_close_to_unsharded(out, cfg):
    """Kernels sum in another order than XLA: logits to float32 rounding, the latent to one bf16
    ulp, the ids exactly the routing of the logits they got, and equal to the reference's; the same
    on every device."""
    assert_every_device_holds_the_same(out)
    expected = unsharded(cfg)
    np.testing.assert_allclose(out.logits, expected["logits"], rtol=1e-5, atol=1e-5)
    ids, routing = reference.route(out.logits, weights(cfg)[BIAS], cfg)
    np.testing.assert_array_equal(out.ids, ids)
    np.testing.assert_array_equal(out.weights, routing)
    # The reference's ids wherever its k-th and (k+1)-th keys are further apart than logits move.
    keys = np.sort(jax.nn.sigmoid(expected["logits"]) + weights(cfg)[BIAS], axis=1)[:, ::-1]
    clear = keys[:, cfg.top_k - 1] - keys[:, cfg.top_k] > 1e-5
    assert clear.sum() >= len(clear) - 1
    np.testing.assert_array_equal(np.asarray(out.ids)[clear], np.asarray(expected["ids"])[clear])
    latent = np.asarray(out.latent, np.float32)
    want = np.asarray(expected["latent"], np.float32)
    assert np.all(np.abs(latent - want) <= 2.0**-7 * np.maximum(np.abs(latent), np.abs(want)))
    got, want = np.asarray(out.shared, np.float32), np.asarray(expected["shared"], np.float32)
    assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + 2.0**-12 * np.abs(want).max())


KERNEL_STAGES = ("front_gemm", "route", "shared_expert")
needs_kernels = pytest.mark.skipif(
    not set(KERNEL_STAGES) <= set(registry.STAGES),
    reason=f"needs Pallas kernels for {KERNEL_STAGES}; registry.STAGES has {tuple(registry.STAGES)}",
)


@needs_kernels
def test_interpret_kernels_under_shard_map():
    """The Pallas kernels (interpret mode) run on every rank, through shard_params and axis_name."""
    mesh = tp_mesh(8)
    params = mf.shard_params(weights(CFG), CFG, mesh)
    out = front(rows(CFG), params, backend="interpret", shared_reduce="psum_scatter")
    assert_close_to_unsharded(out, CFG)

    specs = jax.tree.map(lambda a: a.sharding.spec, params)
    step = jax.shard_map(
        functools.partial(mf.moe_front, axis_name="tp", backend="interpret"),
        mesh=mesh, in_specs=(P(), specs), out_specs=P(), check_vma=False,
    )
    assert_close_to_unsharded(jax.jit(step)(rows(CFG), params), CFG)


@needs_kernels
def test_kernels_under_a_shard_map_that_checks_vma_are_a_value_error():
    """With the default ``check_vma=True``, a kernel's output has no varying-axes type: the call is
    a ValueError that says to pass ``check_vma=False`` (the reference, ``"xla"``, runs there)."""
    mesh = tp_mesh(2)
    params = mf.shard_params(weights(CFG), CFG, mesh)
    specs = jax.tree.map(lambda a: a.sharding.spec, params)
    out_specs = mf.FrontOutput(P(), P(), P(), P(), P(), P(), P())
    step = jax.shard_map(functools.partial(mf.moe_front, axis_name="tp", backend="interpret"),
                         mesh=mesh, in_specs=(P(), specs), out_specs=out_specs)
    with pytest.raises(ValueError, match="backend='interpret' runs Pallas kernels.*pass "
                                         "check_vma=False to the enclosing jax.shard_map"):
        jax.jit(step)(rows(CFG), params)
    step = jax.shard_map(functools.partial(mf.moe_front, axis_name="tp", backend="xla"),
                         mesh=mesh, in_specs=(P(), specs), out_specs=out_specs)
    np.testing.assert_array_equal(jax.jit(step)(rows(CFG), params).ids, unsharded(CFG)["ids"])


@needs_kernels
@pytest.mark.parametrize("shared_reduce", ["psum", "psum_scatter"])
def test_sharded_pallas_front_lowers_for_8_h200s(shared_reduce):
    """The Pallas kernels under shard_map get through the GPU lowering, for a mesh of 8 H200s."""
    mesh = AbstractMesh((8,), ("tp",), abstract_device=H200)
    params = mf.shard_params(weights(CFG), CFG, tp_mesh(8))
    params = dataclasses.replace(
        jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)
            ),
            params,
        ),
        mesh=mesh,
    )
    x = jax.ShapeDtypeStruct((ROWS, CFG.hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    call = jax.jit(functools.partial(mf.moe_front, backend="pallas", shared_reduce=shared_reduce))
    with jax.sharding.use_abstract_mesh(mesh):
        text = call.trace(x, params).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r'"stablehlo\.all_gather"', text)) == 1
    # One Triton call at least per stage: front GEMM, routing, shared expert.
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) >= 3


K3_ROWS = dataclasses.replace(mf.KIMI_K3, hidden=256)
"""Kimi-K3's experts, latent and shared sizes at a small hidden: tp=16 pads 56 router rows to 64."""

SIXTEEN = """
import jax, numpy as np
from jax.sharding import Mesh
import moe_front_jax as mf
assert jax.device_count() == 16, jax.devices()
import test_parallel as t
for shape, names, shared_reduce in [((16,), ("tp",), "psum"), ((16,), ("tp",), "psum_scatter"),
                                    ((2, 8), ("data", "tp"), "psum_scatter")]:
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    params = mf.shard_params(t.weights(t.K3_ROWS), t.K3_ROWS, mesh)
    assert params.split == {16: 64, 8: 112}[mesh.shape["tp"]], params.split
    out = t.front(t.rows(t.K3_ROWS), params, plan=True, backend="xla", shared_reduce=shared_reduce)
    t.assert_matches_unsharded(out, t.K3_ROWS, plan=True)
print("ok")
"""


def test_tp16_on_16_devices_with_k3_row_counts():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SIXTEEN)], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_mailbox_inside_callers_shard_map_equals_the_all_gather_path(backend):
    """Each rank's own mailbox carries every rank's shards: over three steps (more than the two
    generations) the ranks' ids, weights, latent and logits equal the all-gather path's bit for bit
    (these rows hold no -0, the one value the mailbox canonicalizes), the status is 0 and every
    mailbox comes back armed. With ``"interpret"`` and the plan, the routing kernel polls each rank's
    mailbox and writes the plan (``route_collect``, in interpret mode)."""
    mesh = tp_mesh(8)
    params = mf.shard_params(weights(CFG), CFG, mesh)
    specs = jax.tree.map(lambda a: a.sharding.spec, params)
    one = mf.Mailbox.create(CFG.with_tp(8), capacity=8, generations=2)
    buffers = jax.device_put(jnp.stack([one.buffer] * 8), NamedSharding(mesh, P("tp")))
    controls = jax.device_put(jnp.stack([one.control] * 8), NamedSharding(mesh, P("tp")))

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("tp"), P("tp")), out_specs=P("tp"),
        check_vma=backend == "xla",
    )
    def step(x, local, buffer, control):
        box = mf.Mailbox(buffer[0], control[0], one.tickets, local.cfg)
        got, box = mf.moe_front(x, local, axis_name="tp", backend=backend, mailbox=box, plan=True)
        want = mf.moe_front(x, local, axis_name="tp", backend=backend, plan=True)
        pairs = [(getattr(got, f), getattr(want, f)) for f in ("ids", "weights", "latent", "logits")]
        pairs += list(zip(got.plan, want.plan))
        same = jnp.stack([jnp.all(traced_bits(g) == traced_bits(w)) for g, w in pairs])
        return same[None], got.status[None], box.buffer[None], box.control[None]

    for t in range(3):
        x = jax.random.normal(jax.random.key(10 + t), (ROWS, CFG.hidden)).astype(jnp.bfloat16)
        same, status, buffers, controls = step(x, params, buffers, controls)
        assert np.asarray(same).all(), np.asarray(same)
        np.testing.assert_array_equal(np.asarray(status), np.zeros(8))
        armed = np.asarray(one.buffer)
        for r in range(8):
            np.testing.assert_array_equal(np.asarray(buffers[r]), armed)
            np.testing.assert_array_equal(np.asarray(controls[r]), [t % 2, t % 2])


def test_mailbox_with_shard_params_sharded_params_is_refused():
    mesh = tp_mesh(8)
    params = mf.shard_params(weights(CFG), CFG, mesh)
    box = mf.Mailbox.create(CFG.with_tp(8), capacity=8)
    with pytest.raises(NotImplementedError, match="each rank needs its own mailbox"):
        mf.moe_front(rows(CFG), params, mailbox=box)
