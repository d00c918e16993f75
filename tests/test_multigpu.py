"""The tensor-parallel front on several GPUs of one host (Kimi-K3 sizes), against one GPU's reference.

Skipped unless there are at least two GPUs. The expected values come from the XLA reference on one
GPU over ``pack_params(w, cfg)`` (tp=1). GEMMs of other shapes may sum in another order on a GPU, so
the logits agree to float32 rounding, the latent to one bfloat16 ulp, the ids exactly where the
reference's k-th and (k+1)-th keys are apart by more than the logits can move, and the sharded ids are
always exactly the routing of the sharded logits.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.params import BIAS, DOWN, GATE_UP
from bitwise import traced_bits


def gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_count() < 2, reason="needs at least 2 GPUs on this host"),
]

CFG = mf.KIMI_K3
TPS = [tp for tp in (2, 4, 8, 16) if tp <= max(gpu_count(), 2)]


@functools.cache
def weights():
    return mf.init_weights(jax.random.key(0), CFG)


@functools.cache
def rows(b):
    x = jax.random.normal(jax.random.key(b), (b, CFG.hidden), jnp.float32)
    return x.astype(jnp.bfloat16)


@functools.cache
def unsharded(b):
    """The XLA reference on the first device: logits, latent, ids, shared (float32)."""
    device = jax.devices()[0]
    w = {k: jax.device_put(v, device) for k, v in weights().items()}
    x = jax.device_put(rows(b), device)
    local = mf.pack_params(w, CFG)

    @jax.jit
    def run(x, local, gate_up, down):
        logits, latent = reference.front_gemm(x, local.packed, local.split, CFG.experts)
        ids, _ = reference.route(logits, local.bias, CFG)
        return logits, latent, ids, reference.shared_expert(x, gate_up, down, CFG, jnp.float32)

    out = run(x, local, w[GATE_UP], w[DOWN])
    return dict(zip(("logits", "latent", "ids", "shared"), map(np.asarray, out)))


def assert_matches_unsharded(out, b):
    want = unsharded(b)
    logits = np.asarray(out.logits)
    np.testing.assert_allclose(logits, want["logits"], rtol=1e-5, atol=1e-5)
    # The routing of the sharded logits themselves is exact (same device, same function).
    ids, routing = jax.jit(reference.route, static_argnums=2)(
        jnp.asarray(logits), jnp.asarray(weights()[BIAS]), CFG
    )
    np.testing.assert_array_equal(out.ids, ids)
    np.testing.assert_array_equal(out.weights, routing)
    # Against the unsharded ids, wherever the k-th and (k+1)-th keys are clearly apart.
    scores = 1 / (1 + np.exp(-want["logits"].astype(np.float64))) + np.asarray(weights()[BIAS])
    ranked = np.sort(scores, axis=1)[:, ::-1]
    clear = ranked[:, CFG.top_k - 1] - ranked[:, CFG.top_k] > 1e-5
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(np.asarray(out.ids)[clear], want["ids"][clear])
    latent = np.asarray(out.latent, np.float32)
    want_latent = want["latent"].astype(np.float32)
    one_ulp = 2.0**-7 * np.maximum(np.abs(latent), np.abs(want_latent))
    assert np.all(np.abs(latent - want_latent) <= one_ulp)
    got = np.asarray(out.shared, np.float32)
    bound = 2.0**-7 * np.abs(want["shared"]) + 2.0**-12 * np.abs(want["shared"]).max()
    assert np.all(np.abs(got - want["shared"]) <= bound), np.abs(got - want["shared"]).max()


def collectives(compiled_text):
    ops = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    pattern = rf"= \S+ ({ops})(?:-start)?\("
    return sorted(re.findall(pattern, compiled_text))


@pytest.mark.parametrize("backend", ["xla", "auto"])
@pytest.mark.parametrize("shared_reduce", ["psum", "psum_scatter"])
@pytest.mark.parametrize("tp", TPS)
def test_sharded_front_on_gpus_matches_one_gpu(tp, shared_reduce, backend):
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    params = mf.shard_params(weights(), CFG, mesh)
    call = jax.jit(functools.partial(mf.moe_front, backend=backend, shared_reduce=shared_reduce))
    for b in (1, 37, 64):
        x = jax.device_put(rows(b), NamedSharding(mesh, P()))
        assert_matches_unsharded(call(x, params), b)
    reduction = "all-reduce" if shared_reduce == "psum" else "reduce-scatter"
    assert collectives(call.lower(x, params).compile().as_text()) == sorted(["all-gather", reduction])


@pytest.mark.skipif(gpu_count() < 4, reason="a data axis beside tp=2 needs 4 GPUs")
def test_data_axis_beside_tp_on_gpus():
    n = gpu_count() // 2 * 2
    mesh = jax.make_mesh((2, n // 2), ("data", "tp"), devices=jax.devices()[:n])
    params = mf.shard_params(weights(), CFG, mesh)
    x = jax.device_put(rows(64), NamedSharding(mesh, P("data", None)))
    out = jax.jit(mf.moe_front)(x, params)
    assert_matches_unsharded(out, 64)
    assert out.ids.sharding.spec == P("data", None)


@pytest.mark.parametrize("tp", TPS)
def test_per_rank_mailboxes_on_gpus_equal_the_all_gather_path(tp):
    """Each GPU's own mailbox, filled by every rank's peer stores (``transport="peer"``, which
    ``moe_front`` takes with the GPU kernels under ``axis_name``), gives the all-gather path's ids,
    weights, latent and logits bit for bit over more steps than generations, and comes back armed."""
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    params = mf.shard_params(weights(), CFG, mesh)
    specs = jax.tree.map(lambda a: a.sharding.spec, params)
    one = mf.Mailbox.create(CFG.with_tp(tp), capacity=64, generations=2)
    buffers = jax.device_put(jnp.stack([one.buffer] * tp), NamedSharding(mesh, P("tp")))
    controls = jax.device_put(jnp.stack([one.control] * tp), NamedSharding(mesh, P("tp")))

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("tp"), P("tp")), out_specs=P("tp"),
        check_vma=False,
    )
    def step(x, local, buffer, control):
        box = mf.Mailbox(buffer[0], control[0], one.tickets, local.cfg)
        got, box = mf.moe_front(x, local, axis_name="tp", mailbox=box)
        want = mf.moe_front(x, local, axis_name="tp")
        fields = ("ids", "weights", "latent", "logits")
        same = jnp.stack([jnp.all(traced_bits(getattr(got, f)) == traced_bits(getattr(want, f)))
                          for f in fields])
        return same[None], got.status[None], box.buffer[None], box.control[None]

    for t, b in enumerate((1, 37, 64)):
        x = jax.device_put(rows(b), NamedSharding(mesh, P()))
        same, status, buffers, controls = step(x, params, buffers, controls)
        assert np.asarray(same).all(), np.asarray(same)
        np.testing.assert_array_equal(np.asarray(status), np.zeros(tp))
        armed, every_buffer, every_control = map(np.asarray, (one.buffer, buffers, controls))
        for r in range(tp):
            np.testing.assert_array_equal(every_buffer[r], armed)
            np.testing.assert_array_equal(every_control[r], [t % 2, t % 2])
