"""The Lamport mailbox (SPEC section 7): the plain-JAX protocol on CPU, the jax-triton kernels on a GPU.

Expected values come from the direct path (``moe_front`` without a mailbox, or the shards themselves)
and from numpy views of the raw words, never from the mailbox code. Canonicalization (-0 becomes +0)
is applied to the expected values by ``mailbox_cases.canonical_*``, in numpy.
"""

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import moe_front_jax as mf
from moe_front_jax import mailbox as mb
from moe_front_jax import reference
from moe_front_jax.reference import mailbox as layout
from bitwise import assert_bits_equal
from conftest import has_gpu
from mailbox_cases import (SENTINEL, SMALL, TP2, TP8, assert_armed, assert_equals_direct,
                           canonical_latent, canonical_logits, expected_armed, rows_of,
                           shards_with_negative_zeros, tickets_of, weights_of)


@pytest.fixture(scope="module")
def small_params():
    return mf.pack_params(weights_of(SMALL, 0), SMALL)


def test_layout_sizes():
    # Kimi-K3: 5376 sixteen-bit columns = 2688 words = 672 chunks, no padding.
    k3 = mf.KIMI_K3
    assert (layout.latent_words(k3), layout.data_words(k3), layout.row_words(k3)) == (
        1792,
        2688,
        2688,
    )
    assert (layout.data_words(SMALL), layout.row_words(SMALL)) == (43, 44)
    # A counter per 16-row tile of the 896 router and 3584 latent rows; of 26 and 34 at SMALL.
    assert (tickets_of(mf.KIMI_K3), tickets_of(SMALL)) == (56 + 224, 2 + 3)


def test_create_is_armed():
    box = mf.Mailbox.create(SMALL, capacity=5, generations=2)
    assert box.buffer.shape == (2, 5, 44) and box.buffer.dtype == jnp.uint32
    assert box.tickets.shape == (5,) and box.tickets.dtype == jnp.int32
    assert (box.generations, box.capacity, box.words) == (2, 5, 44)
    assert_armed(box, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(capacity=0), "capacity must be a positive int, got 0"),
        (dict(generations=0), "generations must be a positive int, got 0"),
        (dict(capacity=2.0), "capacity must be a positive int, got 2.0"),
    ],
)
def test_create_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mf.Mailbox.create(SMALL, **kwargs)


def test_create_takes_numpy_integers():
    """A capacity or generation count read from a NumPy array (``np.int64``, ``np.int32``) is an
    int: the same mailbox as from Python ints, which then carries a step."""
    box = mf.Mailbox.create(SMALL, capacity=np.int64(8))
    assert box.buffer.shape == (3, 8, 44) and box.buffer.dtype == jnp.uint32
    assert (box.generations, box.capacity, box.words) == (3, 8, 44)
    assert all(type(n) is int for n in (box.generations, box.capacity, box.words))
    assert_armed(box, 0)
    two = mf.Mailbox.create(SMALL, capacity=np.int64(8), generations=np.int32(2))
    assert (two.generations, two.capacity) == (2, 8)
    assert two.control.dtype == jnp.int32
    assert_armed(two, 0)
    for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(mf.Mailbox.create(SMALL, 8, 2))):
        assert_bits_equal(a, b)
    shards = shards_with_negative_zeros(SMALL, 8, seed=11)
    got_logits, got_latent, status, box = mb.exchange(box, *shards, backend="xla")
    assert int(status) == 0
    assert_bits_equal(got_logits, canonical_logits(shards[0]))
    assert_bits_equal(got_latent, canonical_latent(shards[1]))
    assert_armed(box, 1)


def test_create_rejects_odd_latent_shard():
    odd = mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=34, shared=0, tp=2, plan_block=1)
    with pytest.raises(ValueError, match="latent / cfg.tp = 17 must be even"):
        mf.Mailbox.create(odd)
    with pytest.raises(ValueError, match="cfg must be a FrontConfig, got str"):
        mf.Mailbox.create("K3")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_mailbox_output_equals_direct_over_steps(small_params, backend):
    """On ``"interpret"`` the front GEMM kernel publishes from its epilogue and the routing kernel
    collects (``plan=True``); on ``"xla"`` the plain-JAX protocol runs."""
    step = jax.jit(mf.moe_front, static_argnames=("plan", "backend"), donate_argnames="mailbox")
    direct = jax.jit(mf.moe_front, static_argnames=("plan", "backend"))
    box = mf.Mailbox.create(SMALL, capacity=8)
    for t, batch in enumerate([3, 8, 3, 8]):
        x = rows_of(SMALL, batch, seed=t)
        want = direct(x, small_params, plan=True, backend=backend)
        got, box = step(x, small_params, plan=True, backend=backend, mailbox=box)
        assert_equals_direct(got, want, SMALL.plan_block)
        assert_armed(box, t + 1)


def test_a_plan_route_collect_does_not_write_takes_the_separate_kernels():
    """``route_collect`` writes the plan for plan blocks of 2 or more; with ``plan_block=1`` the
    mailbox path collects, routes and plans with the separate kernels and equals the direct path."""
    cfg = dataclasses.replace(SMALL, plan_block=1)
    params = mf.pack_params(mf.init_weights(jax.random.key(5), cfg), cfg)
    x = rows_of(cfg, 3, seed=1)
    want = mf.moe_front(x, params, plan=True, backend="interpret")
    got, box = mf.moe_front(x, params, plan=True, backend="interpret",
                            mailbox=mf.Mailbox.create(cfg, capacity=4))
    assert int(got.status) == 0
    assert_bits_equal(got.ids, want.ids)
    assert_bits_equal(got.weights, want.weights)
    plan = reference.mxfp8_plan(jnp.asarray(canonical_latent(want.latent)), 1)
    assert_bits_equal(got.plan[0], plan[0])
    assert_bits_equal(got.plan[1], plan[1])


@pytest.mark.parametrize("plan, collector", [(False, "route"), (True, "route_collect")])
def test_kernel_path_publishes_from_the_gemm_epilogue(small_params, plan, collector):
    """Where the front GEMM kernel runs, the mailbox path is that kernel publishing from its epilogue
    (no ``front_gemm`` writing logits and latent for a publish to copy), then the routing step."""
    box = mf.Mailbox.create(SMALL, capacity=8)
    jaxpr = str(jax.make_jaxpr(
        lambda x, p, b: mf.moe_front(x, p, plan=plan, backend="interpret", mailbox=b)
    )(rows_of(SMALL, 3, seed=0), small_params, box))
    kernels = re.findall(r"\bfront_gemm\w*|\broute_collect\b|\broute\b(?!_)", jaxpr)
    assert sorted(set(kernels)) == ["front_gemm_publish", collector]


def test_kimi_k3_through_the_mailbox_equals_direct():
    cfg = mf.KIMI_K3
    params = mf.pack_params(weights_of(cfg, 1), cfg)
    box = mf.Mailbox.create(cfg, capacity=4)
    x = rows_of(cfg, 3, seed=3)
    want = jax.jit(mf.moe_front)(x, params)
    got, box = jax.jit(mf.moe_front, donate_argnames="mailbox")(x, params, mailbox=box)
    assert_equals_direct(got, want)
    assert_armed(box, 1)


def test_eager_call_donates_the_mailbox(small_params):
    box = mf.Mailbox.create(SMALL, capacity=4)
    out, new_box = mf.moe_front(rows_of(SMALL, 2, seed=5), small_params, mailbox=box)
    assert box.buffer.is_deleted() and box.control.is_deleted()
    assert int(out.status) == 0
    assert_armed(new_box, 1)
    # The donated mailbox passed again: a ValueError that says what happened and what to pass.
    with pytest.raises(ValueError, match="mailbox's arrays were deleted.*pass the Mailbox that call "
                                         "returned"):
        mf.moe_front(rows_of(SMALL, 2, seed=5), small_params, mailbox=box)
    out, _ = mf.moe_front(rows_of(SMALL, 2, seed=5), small_params, mailbox=new_box)
    assert int(out.status) == 0


def test_negative_zero_rows_are_not_the_sentinel():
    box = mf.Mailbox.create(SMALL, capacity=4)
    logits, latent = shards_with_negative_zeros(SMALL, 4, seed=0)
    published = mb.publish(box, logits, latent, backend="xla")
    rows = np.asarray(published.buffer)[0, :4]
    assert not np.any(rows[:, : layout.data_words(SMALL)] == SENTINEL)
    got_logits, got_latent, status, box = mb.collect(published, 4, backend="xla")
    assert int(status) == 0
    assert_bits_equal(got_logits, canonical_logits(logits))
    assert_bits_equal(got_latent, canonical_latent(latent))
    # Only the exact -0 changed: the subnormals with the sign bit came through.
    assert np.asarray(got_logits).view(np.uint32)[1, 1] == 0x80000001
    assert np.asarray(got_latent).view(np.uint16)[1, 1] == 0x8001
    assert_armed(box, 1)


def test_published_row_layout():
    """Columns [0, L) bf16 latent, [L, L + 2E) float32 logits, in the current generation only."""
    box = mf.Mailbox.create(SMALL, capacity=4)
    for _ in range(2):  # advance to generation 2
        box = mb.exchange(box, *shards_with_negative_zeros(SMALL, 4, seed=9), backend="xla")[3]
    logits, latent = shards_with_negative_zeros(SMALL, 3, seed=1)
    box = mb.publish(box, logits, latent, backend="xla")
    buffer = np.asarray(box.buffer)
    columns = buffer[2, :3].view(np.uint16)  # little-endian: column 2i is the low half of word i
    assert_bits_equal(columns[:, : SMALL.latent].view(ml_dtypes.bfloat16), canonical_latent(latent))
    logit_columns = columns[:, SMALL.latent : SMALL.latent + 2 * SMALL.experts]
    assert_bits_equal(logit_columns.copy().view(np.float32), canonical_logits(logits))
    armed = expected_armed(SMALL, 3, 4)
    assert_bits_equal(buffer[:2], armed[:2])
    assert_bits_equal(buffer[2, 3:], armed[2, 3:])
    assert_bits_equal(buffer[2, :3, 43:], armed[2, :3, 43:])  # padding word untouched


def test_never_published_mailbox_times_out():
    box = mf.Mailbox.create(SMALL, capacity=4)
    logits, latent, status, box = mb.collect(box, 3, backend="xla")
    assert int(status) == mf.Mailbox.TIMEOUT != 0
    assert np.all(np.asarray(logits).view(np.uint32) == SENTINEL)
    assert_armed(box, 0)
    # The next step goes through.
    shards = shards_with_negative_zeros(SMALL, 3, seed=2)
    got_logits, _, status, box = mb.exchange(box, *shards, backend="xla")
    assert int(status) == 0
    assert_bits_equal(got_logits, canonical_logits(shards[0]))


def test_rows_beyond_the_published_batch_time_out():
    box = mf.Mailbox.create(SMALL, capacity=4)
    box = mb.publish(box, *shards_with_negative_zeros(SMALL, 2, seed=3), backend="xla")
    *_, status, box = mb.collect(box, 3, backend="xla")
    assert int(status) == mf.Mailbox.TIMEOUT
    assert_armed(box, 1)


def tp2_shards(batch):
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, batch, TP2.experts_per_rank)).astype(np.float32)
    latent = rng.normal(size=(2, batch, TP2.latent_per_rank)).astype(ml_dtypes.bfloat16)
    return logits, latent


def test_one_rank_missing_times_out_and_both_ranks_complete_the_row():
    logits, latent = tp2_shards(3)
    box = mf.Mailbox.create(TP2, capacity=3)
    partial = mb.publish(box, jnp.asarray(logits[1]), jnp.asarray(latent[1]), 1, backend="xla")
    *_, status, box = mb.collect(partial, 3, backend="xla")
    assert int(status) == mf.Mailbox.TIMEOUT
    for rank in (1, 0):
        box = mb.publish(box, jnp.asarray(logits[rank]), jnp.asarray(latent[rank]), rank, backend="xla")
    got_logits, got_latent, status, box = mb.collect(box, 3, backend="xla")
    assert int(status) == 0
    assert_bits_equal(got_logits, np.concatenate(list(logits), axis=1))
    assert_bits_equal(got_latent, np.concatenate(list(latent), axis=1))
    assert_armed(box, 2)


def test_a_traced_rank_publishes_as_its_int():
    """``rank`` as ``lax.axis_index`` gives it: an int32 scalar traced under ``jit``."""
    logits, latent = (jnp.asarray(a[1]) for a in tp2_shards(3))
    box = mf.Mailbox.create(TP2, capacity=3)
    traced = jax.jit(lambda box, rank: mb.publish(box, logits, latent, rank, backend="xla"))(
        box, jnp.int32(1))
    direct = mb.publish(box, logits, latent, 1, backend="xla")
    assert_bits_equal(traced.buffer, direct.buffer)
    assert_bits_equal(traced.control, direct.control)


def test_exchange_over_eight_ranks_gathers_every_shard():
    tp, batch = TP8.tp, 5
    weights = weights_of(TP8, 2)
    x = rows_of(TP8, batch, seed=6)
    gemm = jax.jit(reference.front_gemm, static_argnums=(2, 3))
    shards = [gemm(x, p.packed, p.split, TP8.experts_per_rank)
              for p in (mf.pack_params(weights, TP8, rank=r) for r in range(tp))]
    logits = jnp.stack([s[0] for s in shards])
    latent = jnp.stack([s[1] for s in shards])
    one = mf.Mailbox.create(TP8, capacity=8)
    buffers = jnp.stack([one.buffer] * tp)
    controls = jnp.stack([one.control] * tp)
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices("cpu")[:tp])

    def rank(buffer, control, logits, latent):
        box = mf.Mailbox(buffer[0], control[0], one.tickets, TP8)
        got_logits, got_latent, status, box = mb.exchange(
            box, logits[0], latent[0], axis_name="tp", backend="xla"
        )
        return got_logits[None], got_latent[None], status[None], box.buffer[None], box.control[None]

    run = jax.jit(jax.shard_map(rank, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    args = jax.device_put((buffers, controls, logits, latent), NamedSharding(mesh, P("tp")))
    got_logits, got_latent, status, buffers, controls = map(np.asarray, run(*args))
    want_logits = canonical_logits(np.concatenate([np.asarray(s[0]) for s in shards], axis=1))
    want_latent = canonical_latent(np.concatenate([np.asarray(s[1]) for s in shards], axis=1))
    np.testing.assert_array_equal(np.asarray(status), np.zeros(tp))
    for r in range(tp):
        assert_bits_equal(got_logits[r], want_logits)
        assert_bits_equal(got_latent[r], want_latent)
        assert_armed(mf.Mailbox(buffers[r], controls[r], one.tickets, TP8), 1)


def test_generations_rotate():
    box = mf.Mailbox.create(SMALL, capacity=2, generations=3)
    shards = shards_with_negative_zeros(SMALL, 2, seed=7)
    for t in range(4):
        published = np.asarray(mb.publish(box, *shards, backend="xla").buffer)
        touched = [g for g in range(3) if np.any(published[g] != expected_armed(SMALL, 3, 2)[g])]
        assert touched == [t % 3]
        box = mb.exchange(box, *shards, backend="xla")[3]
        assert_armed(box, t + 1)


def test_batch_over_capacity_is_a_value_error(small_params):
    box = mf.Mailbox.create(SMALL, capacity=4)
    with pytest.raises(ValueError, match="batch of 5 rows is over the mailbox capacity 4"):
        mf.moe_front(rows_of(SMALL, 5, seed=0), small_params, mailbox=box)
    with pytest.raises(ValueError, match="over the mailbox capacity"):
        mb.collect(box, 5, backend="xla")
    assert not box.buffer.is_deleted()


def test_bad_mailbox_arguments_are_value_errors(small_params):
    x = rows_of(SMALL, 2, seed=0)
    with pytest.raises(ValueError, match="mailbox must be a Mailbox"):
        mf.moe_front(x, small_params, mailbox=np.zeros(3))
    other = mf.Mailbox.create(
        mf.FrontConfig(hidden=64, experts=26, top_k=4, latent=36, shared=0, plan_block=2)
    )
    with pytest.raises(ValueError, match="mailbox was created for"):
        mf.moe_front(x, small_params, mailbox=other)
    box = mf.Mailbox.create(SMALL, capacity=4)
    logits, latent = shards_with_negative_zeros(SMALL, 2, seed=0)
    with pytest.raises(ValueError, match=r"latent_shard must be \[B, 34\] bfloat16"):
        mb.publish(box, logits, latent.astype(jnp.float32), backend="xla")
    with pytest.raises(ValueError, match="latent_shard has 1 rows, expected B = 2"):
        mb.publish(box, logits, latent[:1], backend="xla")
    with pytest.raises(ValueError, match=r"rank must be in \[0, tp=1\)"):
        mb.publish(box, logits, latent, 1, backend="xla")
    with pytest.raises(ValueError, match="batch must be a positive int"):
        mb.collect(box, 0, backend="xla")
    short = dataclasses.replace(box, tickets=box.tickets[:-1])
    with pytest.raises(ValueError, match=r"mailbox.tickets is \(4,\) int32, expected \(5,\) int32"):
        mf.moe_front(x, small_params, mailbox=short)
    tp_box = mf.Mailbox.create(TP2, capacity=2)
    with pytest.raises(ValueError, match="pass axis_name"):
        mb.exchange(tp_box, *(jnp.asarray(a[0, :2]) for a in tp2_shards(2)), backend="xla")


@pytest.mark.skipif(has_gpu(), reason="checks the refusal on a machine without a GPU")
def test_kernels_without_a_gpu_are_a_value_error():
    """``backend="pallas"`` off a GPU is refused by name, pointing at ``"interpret"``."""
    box = mf.Mailbox.create(SMALL, capacity=2)
    with pytest.raises(ValueError, match="backend='pallas'.*use backend='interpret'"):
        mb.collect(box, 2, backend="pallas")
    with pytest.raises(ValueError, match="backend='pallas'.*use backend='interpret'"):
        mb.publish(box, *shards_with_negative_zeros(SMALL, 2, seed=0), backend="pallas")
    assert not box.buffer.is_deleted()


def test_lowered_program_aliases_the_mailbox(small_params):
    box = mf.Mailbox.create(SMALL, capacity=8)
    x = rows_of(SMALL, 5, seed=0)
    lowered = jax.jit(mf.moe_front, donate_argnames="mailbox").lower(x, small_params, mailbox=box)
    hlo = lowered.compile().as_text()
    header = hlo[: hlo.index("\n")]
    # Outputs 5-7 (the returned mailbox) alias parameters 3-5 (the mailbox passed in).
    assert ("input_output_alias={ {5}: (3, {}, may-alias), {6}: (4, {}, may-alias), "
            "{7}: (5, {}, may-alias) }") in header
    entry = hlo[hlo.index("ENTRY"):]
    assert " copy(" not in entry, "the mailbox buffer is copied instead of updated in place"


def test_triton_kernels_compile_for_h200_with_16_byte_volatile_loads(monkeypatch, tmp_path):
    """Triton alone (no jax-triton, no GPU) compiles both kernels for sm_90, with jax-triton's
    signature: pointers of the inputs, then of the outputs (the aliased ones again), then constexprs."""
    triton = pytest.importorskip("triton", reason="no triton: Linux-only wheels")
    # Importing jax_triton (earlier tests on a GPU) sets TRITON_CACHE_DIR to "", where Triton's own
    # compile cannot cache.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_front_jax.bridge import triton_mailbox as tm

    sizes = dict(CAPACITY=256, **tm.layout(mf.KIMI_K3))
    kernels = {
        tm.mailbox_publish: (
            ["*u32", "*i32", "*fp32", "*bf16", "*u32", "*i32", "*i32"], dict(sizes, GENERATIONS=3)
        ),
        tm.mailbox_collect: (
            ["*u32", "*i32", "*i32", "*u32", "*i32", "*bf16", "*fp32", "*i32"],
            dict(sizes, SPIN=tm.TRITON_COLLECT_SPIN_LIMIT, TIMEOUT=mf.Mailbox.TIMEOUT),
        ),
    }
    ptx = {}
    for kernel, (pointers, constants) in kernels.items():
        names = kernel.arg_names
        signature = {names[i]: t for i, t in enumerate(pointers)} | {k: "constexpr" for k in constants}
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
        source = ASTSource(kernel, signature=signature, constexprs=constants, attrs=aligned)
        target = GPUTarget("cuda", 90, 32)
        compiled = triton.compile(source, target=target, options=dict(num_warps=tm.NUM_WARPS))
        ptx[kernel.__name__] = compiled.asm["ptx"]
    assert "ld.global.v4.b32" in ptx["mailbox_publish"]
    assert "st.global.v4.b32" in ptx["mailbox_publish"]
    assert "ld.volatile.global.v4.b32" in ptx["mailbox_collect"]
    assert "st.global.v4.b32" in ptx["mailbox_collect"]


# ---- GPU: the jax-triton kernels on the lent H200 ------------------------------------------------


@pytest.fixture(scope="module")
def k3_params():
    cfg = mf.KIMI_K3
    return mf.pack_params(mf.init_weights(jax.random.key(1), cfg, shared=False), cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "pallas"])
@pytest.mark.parametrize("plan", [False, True])
def test_gpu_mailbox_output_equals_direct_over_steps(k3_params, plan, backend):
    """On ``"pallas"`` at every batch, and on ``"auto"`` at B = 1, the front GEMM kernel publishes
    from its epilogue, with the schedule the direct path runs: ``front_gemm``'s tuned ones (vector at
    B = 1-2, grid split-K at B = 3-4 and 128-256, stream-K at B = 8-64), or with the plan on
    ``"pallas"`` ``front_gemm_plan``'s."""
    step = jax.jit(mf.moe_front, static_argnames=("plan", "backend"), donate_argnames="mailbox")
    direct = jax.jit(mf.moe_front, static_argnames=("plan", "backend"))
    box = mf.Mailbox.create(mf.KIMI_K3, capacity=256)
    for t, batch in enumerate([1, 8, 64, 256, 3, 2, 256]):
        x = rows_of(mf.KIMI_K3, batch, seed=t)
        want = direct(x, k3_params, plan=plan, backend=backend)
        got, box = step(x, k3_params, plan=plan, backend=backend, mailbox=box)
        assert (got.plan is None) == (not plan)
        # With the plan, the plan the collect wrote, of the latent it returned.
        assert_equals_direct(got, want, mf.KIMI_K3.plan_block if plan else None)
        assert_armed(box, t + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [mf.KIMI_K3, SMALL], ids=["k3", "small"])
def test_gpu_kernels_match_the_plain_jax_protocol(cfg):
    """Publish and collect by the kernels leave the same words and return the same bits."""
    box = mf.Mailbox.create(cfg, capacity=8)
    plain = mf.Mailbox.create(cfg, capacity=8)
    for t in range(4):
        shards = shards_with_negative_zeros(cfg, 7, seed=t)
        box = mb.publish(box, *shards, backend="pallas")
        plain = mb.publish(plain, *shards, backend="xla")
        assert_bits_equal(box.buffer, plain.buffer)
        *got, box = mb.collect(box, 7, backend="pallas")
        *want, plain = mb.collect(plain, 7, backend="xla")
        for g, w in zip(got, want):
            assert_bits_equal(g, w)
        assert int(got[2]) == 0
        assert_armed(box, t + 1)
        assert_bits_equal(got[0], canonical_logits(shards[0]))
        assert_bits_equal(got[1], canonical_latent(shards[1]))


@pytest.mark.gpu
def test_gpu_never_published_mailbox_times_out_within_a_second():
    box = mf.Mailbox.create(mf.KIMI_K3, capacity=256)
    collect = jax.jit(lambda box: mb.collect(box, 256, backend="pallas"), donate_argnums=0)
    *_, status, box = collect(box)  # compiles; times out too
    assert int(status) == mf.Mailbox.TIMEOUT
    start = time.perf_counter()
    logits, _, status, box = jax.block_until_ready(collect(box))
    elapsed = time.perf_counter() - start
    assert int(status) == mf.Mailbox.TIMEOUT
    assert elapsed < 1.0, f"the timed-out collect took {elapsed:.3f} s"
    assert np.all(np.asarray(logits).view(np.uint32) == SENTINEL)
    assert_armed(box, 0)
    # Rows beyond the published batch time out too; the mailbox then still works.
    box = mb.publish(box, *shards_with_negative_zeros(mf.KIMI_K3, 2, seed=0), backend="pallas")
    *_, status, box = mb.collect(box, 3, backend="pallas")
    assert int(status) == mf.Mailbox.TIMEOUT
    shards = shards_with_negative_zeros(mf.KIMI_K3, 3, seed=1)
    got_logits, _, status, box = mb.exchange(box, *shards, backend="pallas")
    assert int(status) == 0
    assert_bits_equal(got_logits, canonical_logits(shards[0]))
    assert_armed(box, 2)


@pytest.mark.gpu
def test_gpu_buffer_stays_in_place(k3_params):
    step = jax.jit(mf.moe_front, donate_argnames="mailbox")
    box = mf.Mailbox.create(mf.KIMI_K3, capacity=256)
    def pointers(box):
        return [leaf.unsafe_buffer_pointer() for leaf in (box.buffer, box.control, box.tickets)]

    before = pointers(box)
    for t, batch in enumerate([64, 1, 256]):
        out, box = step(rows_of(mf.KIMI_K3, batch, seed=t), k3_params, mailbox=box)
        assert int(out.status) == 0
        assert pointers(box) == before
    assert_armed(box, 3)
    hlo = step.lower(rows_of(mf.KIMI_K3, 64, seed=0), k3_params, mailbox=box).compile().as_text()
    assert ("input_output_alias={ {5}: (3, {}, may-alias), {6}: (4, {}, may-alias), "
            "{7}: (5, {}, may-alias) }") in hlo
