"""The routing kernels' test cases, shared by the Triton kernel's tests, the Mosaic GPU kernel's
and the dispatch order's: rows of every SPEC edge case and adversarial rows, ids as routing writes
them, the numpy checks of ids, weights and the dispatch, the argument errors, and the GPU comparison
with the XLA reference on the same device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import reference
import oracle

K3 = mf.KIMI_K3

# A row whose first weight, 0.9977603 / 15.902046 = 0.0627441406..., lies within a float32 ulp of the
# bf16 midpoint between 0.0625 and 0.06298828125: multiplying by the reciprocal of the sum, or summing
# the 16 sigmoids in another order than the tree, rounds it to 0.0625.
ROUNDING_ROW = [
    6.09917688369751, 5.819621562957764, 5.649019241333008, 5.522195816040039, 5.414166927337646,
    5.230618476867676, 5.156827926635742, 5.138970375061035, 5.071669578552246, 4.932782173156738,
    4.913704872131348, 4.859700679779053, 4.756407737731934, 4.727040767669678, 4.70028829574585,
    4.671489238739014,
]


def oracle_clear_rows(logits, bias, k, ulps=4):
    """Rows whose oracle keys, sorted, have no two of the top k + 1 within ``ulps`` (bit-equal keys
    are ties, which every implementation breaks by id)."""
    s = oracle.sigmoid32(np.asarray(logits))
    keys = oracle.ordered((s + np.asarray(bias, np.float32)).astype(np.float32)).astype(np.int64)
    top = -np.sort(-keys, axis=1)[:, :k + 1]
    gaps = top[:, :-1] - top[:, 1:]
    return ~((gaps > 0) & (gaps <= ulps)).any(axis=1)


def assert_valid(ids, weights, experts):
    oracle.assert_valid_ids(ids, experts)
    assert not np.isnan(np.asarray(weights, np.float32)).any()


def adversarial_rows(rng, rows, experts):
    """Rows drawn to make ties and specials likely: logits from a few values (many bit-equal keys),
    NaN, +-inf, +-0.0, and normals; biases from a few values, NaN, +-inf and -0.0 too."""
    kinds = rng.integers(0, 4, rows)
    few = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan], np.float32)
    logits = rng.normal(0, 3, (rows, experts)).astype(np.float32)
    pick = few[rng.integers(0, len(few), (rows, experts))]
    coarse = kinds[:, None] == 1  # rows made of a few values only
    sprinkle = (kinds[:, None] == 2) & (rng.random((rows, experts)) < 0.1)  # normals with specials
    logits = np.where(coarse | sprinkle, pick, logits)
    logits[kinds == 3] = np.round(logits[kinds == 3])  # integers: many bit-equal keys
    bias = rng.choice(np.array([0.0, -0.0, 0.01, -0.01, -2.0], np.float32), experts)
    specials = rng.random(experts) < 0.02
    bias[specials] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), specials.sum())
    return logits, bias


def rows_of_kind(kind, rng, batch, experts):
    """Logits and bias of one kind: random normals; ties (a few values, many bit-equal keys; equal
    rows); NaN rows (all NaN, and NaN sprinkled); every row the same (all tokens on the same
    experts)."""
    bias = rng.uniform(-0.05, 0.05, experts).astype(np.float32)
    logits = rng.normal(0, 2, (batch, experts)).astype(np.float32)
    if kind == "ties":
        few = np.array([0.0, -0.0, 1.0, 2.5, -1.0], np.float32)
        logits = few[rng.integers(0, len(few), (batch, experts))]
        logits[::3] = logits[0]  # whole rows equal
        bias = np.zeros(experts, np.float32)
    elif kind == "nan":
        logits[::2] = np.nan
        logits[1::2][rng.random(logits[1::2].shape) < 0.3] = np.nan
    elif kind == "same":
        logits[:] = logits[0]
    return jnp.asarray(logits), jnp.asarray(bias)


def adversarial_ids(rng, batch, cfg):
    """Ids as routing could write them (each row ``K`` distinct experts), drawn to stress the
    bitmap: every row the same experts (one group of B), the highest experts, random experts, and
    rows clustered on a few experts; 32 * W rows fill every bit of every word."""
    e, k = cfg.experts, cfg.top_k
    kinds = rng.integers(0, 4, batch)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(batch)])
    ids[kinds == 0] = np.arange(k)
    ids[kinds == 1] = np.arange(e - k, e)[::-1]
    few = rng.permutation(e)[:2 * k]
    for r in np.flatnonzero(kinds == 2):
        ids[r] = rng.permutation(few)[:k]
    return jnp.asarray(ids.astype(np.int32))


def assert_dispatch(ids, order, group_sizes, inverse, experts):
    """SPEC section 4.1 from the ids alone, in numpy: ``order`` a permutation of the B*K slots,
    experts non-decreasing along it, tokens increasing within an expert, ``group_sizes`` the
    histogram, ``inverse`` the inverse permutation both ways."""
    ids = np.asarray(ids)
    order, group_sizes, inverse = map(np.asarray, (order, group_sizes, inverse))
    batch, k = ids.shape
    n = batch * k
    for name, a, shape in (("order", order, (n,)), ("group_sizes", group_sizes, (experts,)),
                           ("inverse", inverse, (n,))):
        assert a.dtype == np.int32 and a.shape == shape, (name, a.dtype, a.shape)
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    flat = ids.ravel()
    along = flat[order]
    assert (np.diff(along) >= 0).all()
    tokens = order // k
    same = along[1:] == along[:-1]
    assert (np.diff(tokens)[same] > 0).all()
    np.testing.assert_array_equal(group_sizes, np.bincount(flat, minlength=experts))
    assert group_sizes.sum() == n
    np.testing.assert_array_equal(order[inverse], np.arange(n))
    np.testing.assert_array_equal(inverse[order], np.arange(n))
    # Expert e's slots sit at [start_e, start_e + group_sizes[e]).
    starts = np.concatenate([[0], np.cumsum(group_sizes)[:-1]])
    np.testing.assert_array_equal(along, np.repeat(np.arange(experts), group_sizes))
    np.testing.assert_array_equal(inverse[order[starts[group_sizes > 0]]],
                                  starts[group_sizes > 0])


def assert_argument_errors(route):
    """The ``ValueError``s of a routing kernel's ``route(logits, bias, cfg)`` for wrong logits, an
    empty batch and a wrong bias."""
    bias = jnp.zeros((K3.experts,), jnp.float32)
    with pytest.raises(ValueError, match=r"logits must be \[B, experts=896\] float32"):
        route(jnp.zeros((2, 64), jnp.float32), bias, K3)
    with pytest.raises(ValueError, match="logits is an empty batch"):
        route(jnp.zeros((0, 896), jnp.float32), bias, K3)
    with pytest.raises(ValueError, match=r"bias must be \(896,\) float32"):
        route(jnp.zeros((2, 896), jnp.float32), bias[:5], K3)


GPU_ROWS = 100_000
CLEAR_ULPS = 8


def edge_rows(experts):
    """The SPEC's edge cases as rows of one batch (bias zero): ties, NaN, infinities, zeros; at K3's
    896 experts ``assert_edge_ids`` checks their ids."""
    rows = np.zeros((8, experts), np.float32)
    rows[0] = 0.3
    rows[0, ::7] = 0.9
    rows[1, 1::2] = -0.0
    rows[2] = np.nan
    rows[3, :100] = np.nan
    rows[3, 100:] = np.random.default_rng(0).normal(0, 1, experts - 100)
    rows[4, [300, 7]] = np.inf
    rows[4, 1:3] = -np.inf
    rows[5] = -np.inf
    rows[6, 880:] = 5.0
    rows[7] = np.nan
    rows[7, [500, 40, 890, 7, 300]] = [3.0, 2.0, 1.0, 0.0, -1.0]
    return rows


def compare_with_xla_on_gpu(kernel, cfg, on_batch=None):
    """``kernel(logits, bias)`` (its first two outputs ids and weights) on ``GPU_ROWS`` random rows
    and the edge rows, against the XLA reference on the same device: ids equal wherever the
    reference's sorted keys down to rank ``K + 1`` are more than ``CLEAR_ULPS`` apart (the chosen set
    wherever ranks ``K`` and ``K + 1`` are), weights within one bf16 ulp where the ids agree, never a
    NaN weight or a repeated id; ``on_batch(outputs)`` on each batch's outputs. Bit-equal keys count
    as near ties in random rows (the kernel's sigmoid and XLA's differ in the last bits); genuine
    ties are the edge rows. Returns the edge rows' ids."""
    k = cfg.top_k
    rng = np.random.default_rng(11)
    bias = rng.uniform(-0.05, 0.05, cfg.experts).astype(np.float32)
    random_rows = rng.normal(0, 2, (GPU_ROWS, cfg.experts)).astype(np.float32)
    xla = jax.jit(lambda l, b: reference.route(l, b, cfg))
    keys_of = jax.jit(lambda l, b: reference.ordered_key(jax.nn.sigmoid(l) + b))
    edges = jnp.asarray(edge_rows(cfg.experts))
    zero = jnp.zeros(cfg.experts, jnp.float32)
    checked = 0
    for logits, row_bias, ties in [(edges, zero, True)] + [
        (jnp.asarray(random_rows[i:i + 256]), jnp.asarray(bias), False)
        for i in range(0, GPU_ROWS, 256)
    ]:
        outputs = kernel(logits, row_bias)
        if on_batch is not None:
            on_batch(outputs)
        ids, weights = map(np.asarray, outputs[:2])
        ref_ids, ref_weights = map(np.asarray, xla(logits, row_bias))
        assert_valid(ids, weights, cfg.experts)
        keys = np.sort(np.asarray(keys_of(logits, row_bias)).astype(np.int64), axis=1)[:, ::-1]
        gaps = keys[:, :k] - keys[:, 1:k + 1]  # gaps between ranks r and r + 1, r < k
        near = (gaps <= CLEAR_ULPS) & ((gaps > 0) | (not ties))
        clear = ~near.any(axis=1)
        np.testing.assert_array_equal(ids[clear], ref_ids[clear])
        cut_clear = ~near[:, k - 1]
        np.testing.assert_array_equal(np.sort(ids[cut_clear], 1), np.sort(ref_ids[cut_clear], 1))
        same = (ids == ref_ids).all(axis=1)
        assert oracle.bf16_ulp_distance(weights[same], ref_weights[same]).max(initial=0) <= 1
        checked += 0 if ties else int(clear.sum())
    assert checked >= 0.99 * GPU_ROWS, checked
    return np.asarray(kernel(edges, zero)[0])


def assert_edge_ids(edge_ids):
    """The edge rows' ids: ties to the lower id, NaN lowest, infinities."""
    np.testing.assert_array_equal(edge_ids[0], np.arange(16) * 7)
    np.testing.assert_array_equal(edge_ids[1], np.arange(16))
    np.testing.assert_array_equal(edge_ids[2], np.arange(16))
    np.testing.assert_array_equal(edge_ids[4, :3], [7, 300, 0])
    np.testing.assert_array_equal(edge_ids[5], np.arange(16))
    np.testing.assert_array_equal(edge_ids[6], np.arange(880, 896))
    np.testing.assert_array_equal(edge_ids[7], [500, 40, 890, 7, 300, 0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11])
