"""The dispatch order of SPEC section 4.1 (``permute=True``): its properties checked in numpy over
random and adversarial rows (ties, NaN rows, B = 1, 3, 37, 256), the routing kernel that writes it in
the same launch and the standalone kernel in interpret mode bit-equal to the reference, lowering (and
compiling, where Triton is installed) for an H200, the mailbox and sharded paths against the direct
path, and on a GPU bit-equal to the reference."""

import dataclasses
import functools
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

import moe_front_jax as mf
from moe_front_jax import registry, reference
from moe_front_jax.reference import routing as reference_routing
from moe_front_jax.api import Dispatch
from moe_front_jax.pallas.route import kernel as rt
from bitwise import assert_each_bits_equal
from h200 import H200, lower_for_h200, triton_ir_for_h200
from route_cases import adversarial_ids, assert_dispatch, rows_of_kind

K3 = mf.KIMI_K3
CONFIGS = {
    "k3": K3,
    # K not a power of two (8 slots for 6), E not one either (128 lanes for 100).
    "e100_top6": mf.FrontConfig(hidden=256, experts=100, top_k=6, latent=128, shared=0,
                                renormalize=False),
    "e1024_top32": mf.FrontConfig(hidden=256, experts=1024, top_k=32, latent=128, shared=0),
}
BATCHES = (1, 3, 37, 256)


# --- the properties, in numpy --------------------------------------------------------------------


reference_route = jax.jit(reference.route, static_argnums=2, static_argnames="permute")
reference_permutation = jax.jit(reference_routing.permutation, static_argnums=1)


@functools.partial(jax.jit, static_argnames=("cfg", "config"))
def interpret_route(logits, bias, *, cfg, config=None):
    return rt.route(logits, bias, cfg, interpret=True, config=config, permute=True)


@functools.partial(jax.jit, static_argnames="cfg")
def interpret_permutation(ids, *, cfg):
    return rt.permutation(ids, cfg, interpret=True)


def interpret_config(batch, cfg):
    """The picked schedule (one row a program) for small batches; blocks of 64 rows at 256 (one row
    a program is 256 interpreted programs)."""
    config = rt.pick_config(batch, cfg.experts, cfg.top_k)
    return config if batch < 64 else dataclasses.replace(config, block_rows=64)


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "same"])
@pytest.mark.parametrize("name", ["k3", "e100_top6"])
def test_properties_and_interpret_equal_the_reference(name, kind):
    """For B = 1, 3, 37, 256: the reference's dispatch has the SPEC's properties; the routing kernel
    in interpret mode returns the reference's ids, weights and dispatch bit for bit, and the
    standalone kernel the same dispatch from those ids."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(hash((name, kind)) % 2**32)
    for batch in BATCHES:
        logits, bias = rows_of_kind(kind, rng, batch, cfg.experts)
        want = reference_route(logits, bias, cfg, permute=True)
        assert_dispatch(want[0], *want[2:], cfg.experts)
        got = interpret_route(logits, bias, cfg=cfg, config=interpret_config(batch, cfg))
        assert_each_bits_equal(got, want)
        assert_each_bits_equal(interpret_permutation(want[0], cfg=cfg), want[2:])


@pytest.mark.parametrize("block_rows", [1, 2, 4, 8, 64])
def test_blocks_of_rows_and_both_selections(block_rows):
    """Several rows a program (their marks one row at a time in interpret mode; two rows of one
    32-token word choosing the same expert), a ragged last block, both selections."""
    cfg = K3
    logits, bias = rows_of_kind("ties", np.random.default_rng(block_rows), 37, cfg.experts)
    want = reference_route(logits, bias, cfg, permute=True)
    for select in rt.SELECTS:
        got = interpret_route(logits, bias, cfg=cfg, config=rt.RouteConfig(block_rows, 4, select))
        assert_each_bits_equal(got, want)


@pytest.mark.parametrize("name", ["k3", "e100_top6", "e1024_top32"])
def test_standalone_kernel_on_adversarial_ids(name):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(7)
    for batch in (1, 31, 33, 65, 256):
        ids = adversarial_ids(rng, batch, cfg)
        want = reference_permutation(ids, cfg)
        assert_dispatch(ids, *want, cfg.experts)
        assert_each_bits_equal(interpret_permutation(ids, cfg=cfg), want)


def test_largest_covered_batch_and_past_it():
    cfg = K3
    ids = adversarial_ids(np.random.default_rng(8), rt.MAX_PERMUTE_ROWS, cfg)
    want = reference_permutation(ids, cfg)
    assert_dispatch(ids, *want, cfg.experts)
    assert_each_bits_equal(interpret_permutation(ids, cfg=cfg), want)
    past = jnp.zeros((rt.MAX_PERMUTE_ROWS + 1, cfg.top_k), jnp.int32)
    with pytest.raises(NotImplementedError, match="dispatch order of up to 1024 rows"):
        rt.permutation(past, cfg)
    logits = jnp.zeros((rt.MAX_PERMUTE_ROWS + 1, cfg.experts), jnp.float32)
    bias = jnp.zeros((cfg.experts,), jnp.float32)
    with pytest.raises(NotImplementedError, match="dispatch order of up to 1024 rows"):
        rt.route(logits, bias, cfg, permute=True)
    # On an H200 "auto" falls through to the reference past the limit, and takes the kernel below.
    covered_logits, covered_ids = logits[:rt.MAX_PERMUTE_ROWS], past[:rt.MAX_PERMUTE_ROWS]
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
        assert not registry.choose("route", "auto", logits, bias, cfg, permute=True).kernel
        assert registry.choose("route", "auto", logits, bias, cfg).kernel
        assert registry.choose("route", "auto", covered_logits, bias, cfg, permute=True).kernel
        assert registry.choose("permute", "auto", covered_ids, cfg).kernel
        assert not registry.choose("permute", "auto", past, cfg).kernel
    assert rt.permute_bytes(256, 896, 16) == 16 * 1024 * 8 + 24 * 4096 + 4 * 896 + 8


# --- the API -------------------------------------------------------------------------------------


def test_route_and_moe_front_return_a_dispatch():
    cfg = mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=34, shared=0, plan_block=2)
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
    x = jax.random.normal(jax.random.key(1), (5, cfg.hidden)).astype(jnp.bfloat16)
    front = jax.jit(mf.moe_front, static_argnames=("plan", "permute", "backend"))
    plain = front(x, params)
    assert plain.dispatch is None and plain._fields[-1] == "dispatch"
    assert plain._fields[:7] == ("ids", "weights", "latent", "logits", "shared", "plan", "status")
    for backend in ("xla", "interpret"):
        out = front(x, params, permute=True, backend=backend)
        assert isinstance(out.dispatch, Dispatch)
        assert_dispatch(out.ids, *out.dispatch, cfg.experts)
        assert_each_bits_equal(out.dispatch, reference_permutation(out.ids, cfg))
        ids, weights, routed = jax.jit(
            functools.partial(mf.route, cfg=cfg, backend=backend, permute=True)
        )(out.logits, params.bias)
        assert isinstance(routed, Dispatch)
        assert_each_bits_equal((ids, weights, *routed), (out.ids, out.weights, *out.dispatch))
    assert len(mf.route(out.logits, params.bias, cfg)) == 2
    with pytest.raises(ValueError, match="permute must be a bool, got str"):
        mf.moe_front(x, params, permute="yes")
    with pytest.raises(ValueError, match="permute must be a bool, got int"):
        mf.route(out.logits, params.bias, cfg, permute=1)
    with pytest.raises(ValueError, match="permute is traced"):
        jax.jit(lambda x, p: mf.moe_front(x, params, permute=p))(x, True)


def test_registered_stages():
    stage = registry.STAGES["permute"]
    assert stage.reference == "moe_front_jax.reference.routing:permutation"
    assert stage.kernel == "moe_front_jax.pallas.route:permutation"
    ids = jnp.zeros((3, K3.top_k), jnp.int32)
    assert registry.choose("permute", "interpret", ids, K3).kernel
    assert not registry.choose("permute", "xla", ids, K3).kernel
    assert not registry.choose("permute", "auto", ids, K3).kernel  # off a GPU
    logits = jnp.zeros((3, K3.experts), jnp.float32)
    bias = jnp.zeros((K3.experts,), jnp.float32)
    assert registry.choose("route", "interpret", logits, bias, K3, permute=True).kernel
    with pytest.raises(ValueError, match=r"ids must be \[B, top_k=16\] int32"):
        rt.permutation(jnp.zeros((3, 8), jnp.int32), K3)
    with pytest.raises(ValueError, match="ids is an empty batch"):
        rt.permutation(jnp.zeros((0, 16), jnp.int32), K3)


# --- lowering ------------------------------------------------------------------------------------


def test_lowers_for_h200_in_the_routing_launch():
    """K3 at B = 1, 64, 256 (the picked schedules, and blocks of 4 rows at 256): one Triton kernel
    (and the workspace's zeros), no sort, gather or scatter left to XLA; the marks are atomic ors
    (Pallas lowers an integer vector atomic add as ``fadd``); one ticket past one program. The
    standalone kernel likewise."""
    cfg = K3
    bias = jnp.zeros((cfg.experts,), jnp.float32)

    def route(logits, bias, block_rows=None):
        config = rt.pick_config(logits.shape[0], cfg.experts, cfg.top_k)
        if block_rows is not None:
            config = dataclasses.replace(config, block_rows=block_rows)
        return rt.route(logits, bias, cfg, config=config, permute=True)

    for batch, block_rows in [(1, None), (64, None), (256, None), (256, 4)]:
        logits = jnp.zeros((batch, cfg.experts), jnp.float32)
        fn = functools.partial(route, block_rows=block_rows)
        text = lower_for_h200(fn, logits, bias)
        assert text.count("__gpu$xla.gpu.triton") == 1
        for op in ("stablehlo.sort", "top_k", "stablehlo.gather", "stablehlo.scatter"):
            assert op not in text, (batch, op)
        # A new function: jit's cache would skip the lowering that the capture hooks.
        [ttir] = triton_ir_for_h200(functools.partial(route, block_rows=block_rows), logits, bias)
        atomics = re.findall(r"tt\.atomic_rmw (\w+)", ttir)
        assert atomics == (["or"] if batch == 1 else ["or", "add"]), (batch, atomics)
        assert "tt.scan" in ttir and "__nv_popc" in ttir
    for batch in (1, 64, 256):
        ids = jnp.zeros((batch, cfg.top_k), jnp.int32)
        text = lower_for_h200(lambda i: rt.permutation(i, cfg), ids)
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert "stablehlo.sort" not in text and "stablehlo.scatter" not in text


@pytest.mark.parametrize("which, batch", [("route", 1), ("route", 256), ("permutation", 256)])
def test_compiles_for_sm90(which, batch, tmp_path, monkeypatch):
    """Triton (the GPU image's 3.6) compiles the lowered kernels for sm_90 without a GPU: the scan,
    popcounts, gathers, scatter and atomics get through Triton's passes and ptxas, without spills."""
    triton = pytest.importorskip("triton", reason="no triton: Linux-only wheels")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.backends.compiler import GPUTarget

    cfg = K3
    if which == "route":
        config = rt.pick_config(batch, cfg.experts, cfg.top_k)
        args = (jnp.zeros((batch, cfg.experts), jnp.float32), jnp.zeros((cfg.experts,), jnp.float32))
        [ttir] = triton_ir_for_h200(lambda l, b: rt.route(l, b, cfg, permute=True), *args)
        warps = config.num_warps
    else:
        [ttir] = triton_ir_for_h200(lambda i: rt.permutation(i, cfg),
                                    jnp.zeros((batch, cfg.top_k), jnp.int32))
        warps = 4
    path = tmp_path / "kernel.ttir"
    path.write_text(ttir)
    compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=1))
    ptx = compiled.asm["ptx"]
    atomics = sorted(set(re.findall(r"\batom\.global\.[\w.]+", ptx)))
    want = ["atom.global.gpu.acq_rel.or.b32"]
    if which == "permutation" or batch > 1:
        want.insert(0, "atom.global.gpu.acq_rel.add.u32")  # the ticket
    assert atomics == want, atomics
    assert "popc.b32" in ptx
    (tmp_path / "kernel.ptx").write_text(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if os.path.exists(ptxas):
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "kernel.ptx"), "-o",
                               str(tmp_path / "kernel.cubin")], capture_output=True, text=True,
                              check=True).stderr
        assert re.search(r"\b0 bytes spill stores", info), info


# --- the mailbox and sharded paths ---------------------------------------------------------------

SMALL = mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=34, shared=0, plan_block=2)
SHARDED = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=128, shared=128)


@functools.cache
def weights_of(cfg):
    return mf.init_weights(jax.random.key(0), cfg)


def rows(cfg, batch, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, cfg.hidden)).astype(jnp.bfloat16)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("plan", [False, True])
def test_mailbox_path_gives_the_direct_dispatch(backend, plan):
    """Over steps of several batches; with ``"interpret"`` and the plan, ``route_collect`` routes
    and the standalone kernel writes the order from its ids; without the plan the routing kernel
    writes it in its launch."""
    params = mf.pack_params(weights_of(SMALL), SMALL)
    options = dict(plan=plan, permute=True, backend=backend)
    direct = jax.jit(functools.partial(mf.moe_front, **options))
    step = jax.jit(functools.partial(mf.moe_front, **options), donate_argnames="mailbox")
    box = mf.Mailbox.create(SMALL, capacity=8)
    for t, batch in enumerate((3, 8, 1)):
        x = rows(SMALL, batch, seed=t)
        want = direct(x, params)
        got, box = step(x, params, mailbox=box)
        assert int(got.status) == 0
        assert_each_bits_equal((got.ids, *got.dispatch), (want.ids, *want.dispatch))
        assert_dispatch(got.ids, *got.dispatch, SMALL.experts)


def test_exchange_route_returns_the_dispatch_before_the_mailbox():
    from moe_front_jax import mailbox as mb

    params = mf.pack_params(weights_of(SMALL), SMALL)
    x = rows(SMALL, 3)
    logits, latent = reference.front_gemm(x, params.packed, params.split, SMALL.experts)
    box = mf.Mailbox.create(SMALL, capacity=4)
    *out, dispatched, box = mb.exchange_route(box, logits, latent, params.bias, backend="xla",
                                              permute=True)
    assert isinstance(box, mf.Mailbox) and len(out) == 6
    assert_each_bits_equal(dispatched, reference_permutation(out[0], SMALL))
    *out, dispatched, box = mb.exchange_route(box, logits, latent, params.bias, backend="xla")
    assert dispatched is None


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("tp", [2, 8])
def test_sharded_path_gives_the_direct_dispatch(tp, backend):
    """``shard_params``' params over tp ranks: every rank routes all experts, so the dispatch is the
    direct path's."""
    want = jax.jit(functools.partial(mf.moe_front, permute=True))(
        rows(SHARDED, 6), mf.pack_params(weights_of(SHARDED), SHARDED))
    mesh = Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",))
    params = mf.shard_params(weights_of(SHARDED), SHARDED, mesh)
    got = jax.jit(functools.partial(mf.moe_front, permute=True, backend=backend))(
        rows(SHARDED, 6), params)
    assert_each_bits_equal((got.ids, *got.dispatch), (want.ids, *want.dispatch))


def test_inside_callers_shard_map_every_rank_has_the_same_dispatch():
    """``axis_name=`` inside the caller's ``shard_map`` over 8 ranks, through the all-gather and
    through each rank's mailbox: each rank's dispatch is the direct path's."""
    tp = 8
    mesh = Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",))
    params = mf.shard_params(weights_of(SHARDED), SHARDED, mesh)
    specs = jax.tree.map(lambda a: a.sharding.spec, params)
    one = mf.Mailbox.create(SHARDED.with_tp(tp), capacity=8)
    buffers = jax.device_put(jnp.stack([one.buffer] * tp), NamedSharding(mesh, P("tp")))
    controls = jax.device_put(jnp.stack([one.control] * tp), NamedSharding(mesh, P("tp")))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("tp"), P("tp")),
                       out_specs=P("tp"))
    def step(x, local, buffer, control):
        box = mf.Mailbox(buffer[0], control[0], one.tickets, local.cfg)
        gathered = mf.moe_front(x, local, axis_name="tp", backend="xla", permute=True)
        boxed, _ = mf.moe_front(x, local, axis_name="tp", backend="xla", permute=True, mailbox=box)
        return tuple(jnp.stack([a, b])[None] for a, b in zip(gathered.dispatch, boxed.dispatch))

    x = rows(SHARDED, 6)
    want = jax.jit(functools.partial(mf.moe_front, permute=True))(
        x, mf.pack_params(weights_of(SHARDED), SHARDED)).dispatch
    got = step(x, params, buffers, controls)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.shape == (tp, 2, *w.shape)
        for rank in range(tp):
            for path in range(2):
                np.testing.assert_array_equal(g[rank, path], np.asarray(w))


def readme_layer(front, gate_up, down, k):
    """The README's recipe over ``front``'s dispatch: gather the latent by ``order // K``, two
    ``ragged_dot``s over ``group_sizes``, back to (token, rank) by ``inverse``, weighted sum."""
    d = front.dispatch
    latent = front.latent.shape[1]
    grouped = front.latent[d.order // k]
    h = jax.lax.ragged_dot(grouped, gate_up, d.group_sizes, preferred_element_type=jnp.float32)
    g, u = jnp.split(h, 2, axis=-1)
    y = jax.lax.ragged_dot((jax.nn.silu(g) * u).astype(jnp.bfloat16), down, d.group_sizes,
                           preferred_element_type=jnp.float32)
    per_slot = y[d.inverse].reshape(-1, k, latent)
    return jnp.einsum("bk,bkl->bl", front.weights.astype(jnp.float32), per_slot)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("shape, names", [((2, 4), ("data", "tp")), ((2, 2, 2), ("tp", "data", "seq"))])
def test_data_parallel_mesh_gives_the_global_dispatch(shape, names, backend):
    """Over a mesh with data-parallel axes beside ``"tp"``, ``FrontOutput.dispatch`` is global:
    ``order``/``inverse`` over all ``B * K`` slots and ``group_sizes`` ``[E]``, the unsharded call's
    bits (the stable sort of the global ids); the README's recipe over it gives the unsharded
    layer's output."""
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), names)
    params = mf.shard_params(weights_of(SHARDED), SHARDED, mesh)
    x = rows(SHARDED, 8)
    call = jax.jit(functools.partial(mf.moe_front, permute=True, backend=backend))
    got = call(x, params)
    want = jax.jit(functools.partial(mf.moe_front, permute=True))(
        x, mf.pack_params(weights_of(SHARDED), SHARDED))
    k, e = SHARDED.top_k, SHARDED.experts
    assert got.dispatch.order.shape == (8 * k,) and got.dispatch.group_sizes.shape == (e,)
    assert_each_bits_equal((got.ids, *got.dispatch), (want.ids, *want.dispatch))
    assert_each_bits_equal(got.dispatch, reference_permutation(want.ids, SHARDED))
    order, inverse = np.asarray(got.dispatch.order), np.asarray(got.dispatch.inverse)
    np.testing.assert_array_equal(order[inverse], np.arange(8 * k))

    k1, k2 = jax.random.split(jax.random.key(2))
    latent, inner = SHARDED.latent, 16
    gate_up = (jax.random.normal(k1, (e, latent, 2 * inner)) / latent**0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(k2, (e, inner, latent)) / inner**0.5).astype(jnp.bfloat16)
    layer = jax.jit(functools.partial(readme_layer, k=k))
    np.testing.assert_array_equal(np.asarray(layer(got, gate_up, down)),
                                  np.asarray(layer(want, gate_up, down)))


# --- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("select", rt.SELECTS)
def test_gpu_bit_equal_to_the_reference(select):
    """On the device, for B = 1, 3, 37, 64, 256 and the kinds of rows above, 20 draws each: the
    routing kernel's dispatch equals the reference's over the kernel's own ids bit for bit (ids
    themselves may differ from XLA's at near ties: test_route_kernel's GPU test), with one row a
    program (the picked schedules) and 4 rows a program; the standalone kernel likewise, over
    adversarial ids up to ``MAX_PERMUTE_ROWS``. Repeated draws look for races in the ticket
    hand-off."""
    cfg = K3
    rng = np.random.default_rng(13)
    permutation = jax.jit(reference_routing.permutation, static_argnums=1)

    def route(logits, bias, block_rows):
        config = dataclasses.replace(rt.pick_config(logits.shape[0], cfg.experts, cfg.top_k),
                                     select=select)
        if block_rows:
            config = dataclasses.replace(config, block_rows=block_rows)
        return rt.route(logits, bias, cfg, config=config, permute=True)

    kernels = {rows_: jax.jit(functools.partial(route, block_rows=rows_)) for rows_ in (None, 4)}
    standalone = jax.jit(lambda ids: rt.permutation(ids, cfg))
    for batch in (1, 3, 37, 64, 256):
        for draw in range(20):
            kind = ("random", "ties", "nan", "same")[draw % 4]
            logits, bias = rows_of_kind(kind, rng, batch, cfg.experts)
            for kernel in kernels.values():
                ids, _, *got = kernel(logits, bias)
                assert_each_bits_equal(got, permutation(ids, cfg))
                assert_dispatch(ids, *got, cfg.experts)
    for batch in (1, 31, 33, 256, rt.MAX_PERMUTE_ROWS):
        for _ in range(5):
            ids = adversarial_ids(rng, batch, cfg)
            assert_each_bits_equal(standalone(ids), permutation(ids, cfg))


@pytest.mark.gpu
def test_gpu_front_paths_give_the_reference_dispatch():
    """``moe_front(permute=True)`` with the kernels (``"pallas"``), direct and through a mailbox
    with the plan (``route_collect`` then the standalone kernel): the reference's dispatch of the
    ids it returns."""
    cfg = K3
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
    options = dict(permute=True, plan=True, backend="pallas")
    direct = jax.jit(functools.partial(mf.moe_front, **options))
    step = jax.jit(functools.partial(mf.moe_front, **options), donate_argnames="mailbox")
    box = mf.Mailbox.create(cfg, capacity=256)
    for batch in (1, 64, 256):
        x = rows(cfg, batch, seed=batch)
        for out in (direct(x, params), None):
            if out is None:
                out, box = step(x, params, mailbox=box)
                assert int(out.status) == 0
            assert_each_bits_equal(out.dispatch, reference_permutation(out.ids, cfg))


def test_dispatch_is_exported_from_the_api():
    assert Dispatch._fields == ("order", "group_sizes", "inverse")
