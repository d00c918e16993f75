"""The peer-store transport of the Lamport mailbox: CPU lowering and protocol, GPU runs.

On the CPU: the Mosaic GPU publish lowers for one H200 (a rank storing to itself) and for eight
(peer pointers from XLA's collective metadata, no NVSHMEM, no multicast), and a plain-JAX model of
the peer stores (each rank writing its words into every rank's mailbox at its own generation) shows
why ``exchange`` asks for at least two generations. On one GPU: the kernel at tp = 1 against the
plain-JAX publish and the shards themselves, byte for byte over several steps. On several GPUs
(skipped with fewer than two): tp = the GPU count against the single-GPU exchange.

Expected values are the shards (canonicalized in numpy by ``test_mailbox``'s helpers), the plain-JAX
publish's words, or the one-GPU result: never the kernel's own output.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_front_jax as mf
from moe_front_jax import mailbox as mb
from moe_front_jax import reference
from bitwise import assert_bits_equal
from h200 import H200, lower_for_h200
from mailbox_cases import (
    SENTINEL,
    SMALL,
    TP2,
    TP8,
    assert_armed,
    canonical_latent,
    canonical_logits,
    expected_armed,
    shards_with_negative_zeros,
)


def gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def mosaic_calls(stablehlo: str) -> list[str]:
    """The ``mosaic_gpu_v2`` custom calls of a lowered program, their kernel bytecode included."""
    return [line for line in stablehlo.splitlines() if "custom_call @mosaic_gpu_v2" in line]


def backend_config(call: str) -> str:
    """The call's attributes without its serialized kernel."""
    return re.sub(r'module = "[^"]*"', "module = ...", call)


def no_multicast_or_nvshmem(call: str) -> None:
    for banned in ("multimem", "multicast", "nvshmem"):
        assert banned not in call, f"the peer publish uses {banned}"


def peer_publish(box, logits, latent, axis_name=None):
    """``peer_mailbox.publish`` over the mailbox's arrays; returns ``(mailbox, status)``."""
    from moe_front_jax.bridge import peer_mailbox

    buffer, control, status = peer_mailbox.publish(box.buffer, box.control, logits, latent, box.cfg,
                                                   axis_name)
    return dataclasses.replace(box, buffer=buffer, control=control), status


def triton_collect(box, batch, status):
    """``triton_mailbox.collect`` over the mailbox's arrays; returns ``(logits, latent, status,
    mailbox)``."""
    from moe_front_jax.bridge import triton_mailbox

    logits, latent, status, buffer, control = triton_mailbox.collect(
        box.buffer, box.control, status, batch, box.cfg)
    return logits, latent, status, dataclasses.replace(box, buffer=buffer, control=control)


# ---- CPU: lowering for H200s ----------------------------------------------------------------------


def test_peer_publish_lowers_for_one_h200_in_place():
    box = mf.Mailbox.create(SMALL, capacity=8)
    logits, latent = shards_with_negative_zeros(SMALL, 3, seed=0)
    text = lower_for_h200(peer_publish, box, logits, latent)
    [call] = mosaic_calls(text)
    config = backend_config(call)
    assert "uses_xla_collective_metadata = false" in config
    assert "skip_device_barrier = true" in config
    # Operands: logit words, latent words, control, buffer; control and buffer come back aliased.
    assert "(tensor<3x26xui32>, tensor<3x17xui32>, tensor<2xi32>, tensor<3x8x44xui32>)" in config
    assert "output_tuple_indices = [1], operand_index = 2" in config
    assert "output_tuple_indices = [2], operand_index = 3" in config
    no_multicast_or_nvshmem(call)


@pytest.mark.parametrize("cfg", [TP2, TP8], ids=["tp2", "tp8"])
def test_peer_publish_lowers_for_h200s_with_collective_metadata(cfg):
    """Under shard_map over tp H200s of one process the peer pointers come from XLA's collective
    metadata (no NVSHMEM) and the cross-device barrier is skipped."""
    tp, batch = cfg.tp, 5
    mesh = AbstractMesh((tp,), ("tp",), abstract_device=H200)
    box = mf.Mailbox.create(cfg, capacity=8)

    def sharded(shape, dtype):
        return jax.ShapeDtypeStruct((tp, *shape), dtype, sharding=NamedSharding(mesh, P("tp")))

    args = (
        sharded(box.buffer.shape, jnp.uint32),
        sharded((2,), jnp.int32),
        sharded((batch, cfg.experts_per_rank), jnp.float32),
        sharded((batch, cfg.latent_per_rank), jnp.bfloat16),
    )

    def rank(buffer, control, logits, latent):
        local = mf.Mailbox(buffer[0], control[0], box.tickets, cfg)
        local, status = peer_publish(local, logits[0], latent[0], axis_name="tp")
        return local.buffer[None], local.control[None], status[None]

    run = jax.shard_map(rank, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    [call] = mosaic_calls(text)
    config = backend_config(call)
    assert "uses_xla_collective_metadata = true" in config
    assert "skip_device_barrier = true" in config
    logit_words = f"tensor<{batch}x{cfg.experts_per_rank}xui32>"
    assert f"{logit_words}, tensor<{batch}x{cfg.latent_per_rank // 2}xui32>" in config
    no_multicast_or_nvshmem(call)


def test_a_peer_ref_on_one_device_would_need_nvshmem():
    """Why the tp = 1 kernel stores through its own operand: outside a multi-device mesh Mosaic GPU
    translates ``remote_ref`` with ``nvshmem_ptr`` (NVSHMEM and its symmetric heap), not with XLA's
    collective metadata."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)

    def body(x_ref, o_ref):
        plgpu.remote_ref(o_ref, {"x": 0})[...] = x_ref[...]

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((256,), jnp.int32), grid=(1,),
                          grid_names=("b",), compiler_params=params)
    run = jax.shard_map(kernel, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    x = jnp.arange(256, dtype=jnp.int32)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(run).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    [call] = mosaic_calls(text)
    assert "uses_xla_collective_metadata = false" in backend_config(call)
    assert "nvshmem_ptr" in call


# ---- CPU: the transport's arguments -----------------------------------------------------------------


def test_peer_transport_needs_the_gpu_kernels_and_two_generations():
    box = mf.Mailbox.create(SMALL, capacity=4)
    shards = shards_with_negative_zeros(SMALL, 2, seed=0)
    with pytest.raises(ValueError, match="transport must be one of"):
        mb.exchange(box, *shards, backend="xla", transport="nvls")
    if gpu_count() == 0:
        with pytest.raises(NotImplementedError, match="transport='peer' stores through GPU peer"):
            mb.exchange(box, *shards, backend="xla", transport="peer")
    one = mf.Mailbox.create(TP2, capacity=2, generations=1)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    logits = jnp.zeros((2, 2, TP2.experts_per_rank), jnp.float32)
    latent = jnp.zeros((2, 2, TP2.latent_per_rank), jnp.bfloat16)
    logits, latent = jax.device_put((logits, latent), NamedSharding(mesh, P("tp")))

    def rank(logits, latent):
        return mb.exchange(one, logits[0], latent[0], axis_name="tp", transport="peer")[2][None]

    run = jax.shard_map(rank, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    with pytest.raises(ValueError, match="needs generations >= 2"):
        jax.jit(run)(logits, latent)


# ---- CPU: the peer-store protocol, modelled in plain JAX ------------------------------------------


def peer_store(boxes, rank, logits, latent):
    """Rank ``rank``'s peer publish: its words into EVERY rank's buffer, at the generation its own
    control gives (``mb.publish`` on the peer's buffer under this rank's control words); only its own
    control records the generation."""
    own = boxes[rank].control
    stored = []
    for box in boxes:
        published = mb.publish(dataclasses.replace(box, control=own), logits, latent, rank,
                               backend="xla")
        stored.append(dataclasses.replace(box, buffer=published.buffer))
    stored[rank] = dataclasses.replace(stored[rank], control=published.control)
    return stored


def step_shards(cfg, batch, step):
    rng = np.random.default_rng(100 + step)
    logits = rng.normal(size=(cfg.tp, batch, cfg.experts_per_rank)).astype(np.float32)
    latent = rng.normal(size=(cfg.tp, batch, cfg.latent_per_rank)).astype(ml_dtypes.bfloat16)
    logits[:, 0, 0], latent[:, 0, 0] = -0.0, -0.0
    return logits, latent


@pytest.mark.parametrize("cfg", [TP2, TP8], ids=["tp2", "tp8"])
def test_a_fast_rank_never_overwrites_an_uncollected_step_with_two_generations(cfg):
    """Rank 0 runs one step ahead of every other rank: it has collected step t and stored step t+1
    into every mailbox before the others collect step t. With G = 2 every rank still collects each
    step exactly; with G = 1 the late ranks read rank 0's step t+1 in place of its step t."""
    batch = 3
    for generations, exact in ((2, True), (1, False)):
        boxes = [mf.Mailbox.create(cfg, capacity=4, generations=generations)] * cfg.tp
        steps = [step_shards(cfg, batch, t) for t in range(4)]
        for r in range(cfg.tp):
            boxes = peer_store(boxes, r, *(jnp.asarray(a[r]) for a in steps[0]))
        for t in range(3):
            want_logits = canonical_logits(np.concatenate(list(steps[t][0]), axis=1))
            want_latent = canonical_latent(np.concatenate(list(steps[t][1]), axis=1))
            got_logits, got_latent, status, boxes[0] = mb.collect(boxes[0], batch, backend="xla")
            assert int(status) == 0
            assert_bits_equal(got_logits, want_logits)
            boxes = peer_store(boxes, 0, *(jnp.asarray(a[0]) for a in steps[t + 1]))
            late = []
            for r in range(1, cfg.tp):
                got_logits, got_latent, status, boxes[r] = mb.collect(boxes[r], batch, backend="xla")
                late.append((int(status), np.asarray(got_logits), np.asarray(got_latent)))
                boxes = peer_store(boxes, r, *(jnp.asarray(a[r]) for a in steps[t + 1]))
            if exact:
                for status, got_logits, got_latent in late:
                    assert status == 0
                    assert_bits_equal(got_logits, want_logits)
                    assert_bits_equal(got_latent, want_latent)
            else:
                ahead = canonical_logits(steps[t + 1][0][0])
                for _, got_logits, _ in late:
                    assert_bits_equal(got_logits[:, : cfg.experts_per_rank], ahead)
        if exact:
            for r in range(cfg.tp):
                *_, status, box = mb.collect(boxes[r], batch, backend="xla")
                assert int(status) == 0
                assert_armed(box, 4)


# ---- GPU: tp = 1 on one GPU ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_shards():
    cfg = mf.KIMI_K3
    params = mf.pack_params(mf.init_weights(jax.random.key(1), cfg, shared=False), cfg)
    gemm = jax.jit(reference.front_gemm, static_argnums=(2, 3))

    def shards(batch, seed):
        x = jax.random.normal(jax.random.key(seed), (batch, cfg.hidden)).astype(jnp.bfloat16)
        logits, latent = gemm(x, params.packed, params.split, cfg.experts_per_rank)
        # -0 in the first row, so canonicalization is exercised on real front-GEMM output.
        return logits.at[0, ::7].set(-0.0), latent.at[0, ::5].set(-0.0)

    return shards


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [mf.KIMI_K3, SMALL], ids=["k3", "small"])
def test_gpu_peer_publish_matches_the_plain_jax_publish(cfg):
    """The Mosaic GPU publish (a rank storing to itself) leaves the plain-JAX publish's words."""
    publish = jax.jit(peer_publish, donate_argnums=0)
    box = mf.Mailbox.create(cfg, capacity=8)
    plain = mf.Mailbox.create(cfg, capacity=8)
    for t in range(4):
        shards = shards_with_negative_zeros(cfg, 7 - t, seed=t)
        box, status = publish(box, *shards)
        plain = mb.publish(plain, *shards, backend="xla")
        assert int(status) == 0
        assert_bits_equal(box.buffer, plain.buffer)
        assert_bits_equal(box.control, plain.control)
        *got, box = triton_collect(box, 7 - t, status)
        *_, plain = mb.collect(plain, 7 - t, backend="xla")
        assert int(got[2]) == 0
        assert_bits_equal(got[0], canonical_logits(shards[0]))
        assert_bits_equal(got[1], canonical_latent(shards[1]))
        assert_armed(box, t + 1)


@pytest.mark.gpu
def test_gpu_peer_exchange_equals_the_direct_path_over_steps(k3_shards):
    box = mf.Mailbox.create(mf.KIMI_K3, capacity=256)
    gathered = mf.Mailbox.create(mf.KIMI_K3, capacity=256)
    for t, batch in enumerate([1, 8, 64, 256, 3, 64]):
        logits, latent = k3_shards(batch, seed=t)
        got_logits, got_latent, status, box = mb.exchange(box, logits, latent, transport="peer")
        assert int(status) == 0
        assert_bits_equal(got_logits, canonical_logits(logits))
        assert_bits_equal(got_latent, canonical_latent(latent))
        assert_armed(box, t + 1)
        # The default transport (the jax-triton publish) returns the same bits.
        *want, gathered = mb.exchange(gathered, logits, latent)
        assert_bits_equal(got_logits, want[0])
        assert_bits_equal(got_latent, want[1])


@pytest.mark.gpu
def test_gpu_peer_exchange_times_out_on_missing_rows_and_recovers(k3_shards):
    box = mf.Mailbox.create(mf.KIMI_K3, capacity=256)
    collect = jax.jit(lambda box: mb.collect(box, 256, backend="pallas"), donate_argnums=0)
    logits, _, status, box = collect(box)  # never published
    assert int(status) == mf.Mailbox.TIMEOUT
    assert np.all(np.asarray(logits).view(np.uint32) == SENTINEL)
    assert_armed(box, 0)
    box, status = jax.jit(peer_publish)(box, *k3_shards(2, seed=9))
    *_, status, box = triton_collect(box, 3, status)  # row 2 never published
    assert int(status) == mf.Mailbox.TIMEOUT
    assert_bits_equal(box.buffer, expected_armed(mf.KIMI_K3, 3, 256))
    logits, latent = k3_shards(3, seed=10)
    got_logits, _, status, box = mb.exchange(box, logits, latent, transport="peer")
    assert int(status) == 0
    assert_bits_equal(got_logits, canonical_logits(logits))
    assert_armed(box, 2)


# ---- several GPUs: tp = the GPU count ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs at least 2 GPUs on this host")
def test_gpus_peer_exchange_matches_one_gpu():
    tp = gpu_count()
    cfg = mf.KIMI_K3.with_tp(tp)
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    one = mf.Mailbox.create(cfg, capacity=64)
    sharded = NamedSharding(mesh, P("tp"))
    buffers = jax.device_put(jnp.stack([one.buffer] * tp), sharded)
    controls = jax.device_put(jnp.stack([one.control] * tp), sharded)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    def step(buffers, controls, logits, latent):
        box = mf.Mailbox(buffers[0], controls[0], one.tickets, cfg)
        got_logits, got_latent, status, box = mb.exchange(
            box, logits[0], latent[0], axis_name="tp", transport="peer"
        )
        return box.buffer[None], box.control[None], got_logits[None], got_latent[None], status[None]

    single = mf.Mailbox.create(mf.KIMI_K3, capacity=64)
    for t, batch in enumerate([1, 8, 64, 5]):
        rng = np.random.default_rng(t)
        logits = rng.normal(size=(batch, cfg.experts)).astype(np.float32)
        latent = rng.normal(size=(batch, cfg.latent)).astype(ml_dtypes.bfloat16)
        logits[0, ::3], latent[0, ::3] = -0.0, -0.0
        # The single-GPU result: the whole row through one GPU's peer exchange (tp = 1).
        want_logits, want_latent, status, single = mb.exchange(
            single, jnp.asarray(logits), jnp.asarray(latent), transport="peer"
        )
        assert int(status) == 0
        rank_logits = logits.reshape(batch, tp, -1).transpose(1, 0, 2)
        rank_latent = latent.reshape(batch, tp, -1).transpose(1, 0, 2)
        args = jax.device_put((rank_logits, rank_latent), sharded)
        buffers, controls, got_logits, got_latent, statuses = step(buffers, controls, *args)
        np.testing.assert_array_equal(np.asarray(statuses), np.zeros(tp))
        for r in range(tp):
            assert_bits_equal(np.asarray(got_logits)[r], want_logits)
            assert_bits_equal(np.asarray(got_latent)[r], want_latent)
            box = mf.Mailbox(np.asarray(buffers)[r], np.asarray(controls)[r], one.tickets, cfg)
            assert_armed(box, t + 1)
