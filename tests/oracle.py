"""Independent numpy oracles for the tests: float64 arithmetic (or explicit float32 where the SPEC
fixes float32 operations), written from SPEC.md without calling the code under test."""

import math

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def sigmoid32(x) -> np.ndarray:
    """float32 sigmoid, correctly rounded from float64."""
    x64 = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x64))).astype(F32)


def ordered(key32) -> np.ndarray:
    """SPEC section 4 step 2, in numpy: a monotone uint32 of float32 ``key32``; NaN -> 0."""
    key32 = np.asarray(key32, F32)
    bits = key32.view(np.uint32)
    out = np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))
    return np.where(np.isnan(key32), np.uint32(0), out).astype(np.uint32)


def tree_sum32(values) -> np.ndarray:
    """Pairwise tree sum over the last axis in float32, zero-padded to a power of two."""
    v = np.asarray(values, F32)
    width = 1 << (v.shape[-1] - 1).bit_length()
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (width - v.shape[-1],), F32)], axis=-1)
    while v.shape[-1] > 1:
        v = (v[..., 0::2] + v[..., 1::2]).astype(F32)
    return v[..., 0]


def route(logits, bias, top_k, scale=1.0, renormalize=True):
    """SPEC section 4 in numpy: (ids int32 [B, K], weights bfloat16 [B, K])."""
    logits = np.asarray(logits, F32)
    s = sigmoid32(logits)
    keys = ordered((s + np.asarray(bias, F32)).astype(F32))
    experts = np.broadcast_to(np.arange(logits.shape[-1]), logits.shape)
    # lexsort: last key is primary; descending key, then ascending expert id.
    order = np.lexsort((experts, -keys.astype(np.int64)), axis=-1)
    ids = order[:, :top_k].astype(np.int32)
    w = np.take_along_axis(s, ids, axis=-1)
    w = np.where(np.isnan(w), F32(0), w).astype(F32)
    scaled = (w * F32(scale)).astype(F32)
    if renormalize:
        total = tree_sum32(w)[:, None]
        scaled = (scaled / (total + F32(1e-20))).astype(F32)
    return ids, scaled.astype(BF16)


def _ranked(keys_row, candidates) -> list[int]:
    """``candidates`` by descending ordered key, ties to the lower id (SPEC section 4 step 3)."""
    return sorted(candidates, key=lambda e: (-int(keys_row[e]), e))


def _weights(chosen, scale, renormalize):
    w = np.where(np.isnan(chosen), F32(0), chosen).astype(F32)
    scaled = (w * F32(scale)).astype(F32)
    if renormalize:
        scaled = (scaled / (tree_sum32(w)[:, None] + F32(1e-20))).astype(F32)
    return scaled.astype(BF16)


def kept_groups(keys32, groups, topk_groups) -> list[list[int]]:
    """SPEC section 4.2 per row: the kept group ids, increasing. A group's score is the float32
    sum of its two largest keys by ``ordered``; the best ``topk_groups``, ties to the lower id."""
    keys32 = np.asarray(keys32, F32)
    n = keys32.shape[1] // groups
    kept = []
    for row in keys32:
        order = ordered(row)
        scores = []
        for g in range(groups):
            best = _ranked(order, range(g * n, (g + 1) * n))[:2]
            scores.append(F32(row[best[0]]) + F32(row[best[1]]))
        kept.append(sorted(_ranked(ordered(np.asarray(scores, F32)), range(groups))[:topk_groups]))
    return kept


def route_grouped(logits, bias, top_k, groups, topk_groups, scale=1.0, renormalize=True):
    """SPEC sections 4 and 4.2 in numpy, a row at a time: (ids int32 [B, K], weights bf16 [B, K])."""
    s = sigmoid32(logits)
    keys = (s + np.asarray(bias, F32)).astype(F32)
    n = keys.shape[1] // groups
    ids = []
    for row, kept in zip(keys, kept_groups(keys, groups, topk_groups)):
        candidates = [e for g in kept for e in range(g * n, (g + 1) * n)]
        ids.append(_ranked(ordered(row), candidates)[:top_k])
    ids = np.asarray(ids, np.int32)
    return ids, _weights(np.take_along_axis(s, ids, axis=-1), scale, renormalize)


def route_softmax(logits, top_k, scale=1.0, renormalize=True):
    """SPEC section 4.3 in float64: ids by the logits' ordered keys, weights from the row's softmax
    (NaN logits as -inf; a NaN probability weighs 0), renormalized over the chosen."""
    logits = np.asarray(logits, F32)
    experts = np.broadcast_to(np.arange(logits.shape[-1]), logits.shape)
    ids = np.lexsort((experts, -ordered(logits).astype(np.int64)), axis=-1)[:, :top_k].astype(np.int32)
    finite = np.where(np.isnan(logits), -np.inf, logits).astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(finite - finite.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    w = np.take_along_axis(p, ids, axis=-1)
    w = np.where(np.isnan(w), 0.0, w)
    if renormalize:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, (w * scale).astype(BF16)


def bf16_ulp(v) -> np.ndarray:
    """The bfloat16 unit in the last place at magnitude ``v`` (float64 in and out; subnormals' ulp
    below 2**-126)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-126)))
    return np.exp2(exponent - 7)


def bf16_ulp_distance(a, b) -> np.ndarray:
    """Distance in bfloat16 ulps (units in the last place) between bfloat16 arrays ``a`` and ``b``."""

    def line(v):
        bits = np.asarray(v, BF16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)

    return np.abs(line(a) - line(b))


def e8m0_byte(q: float) -> int:
    """Smallest b in [0, 254] with 2**(b - 127) >= q (exact arithmetic), saturating."""
    if math.isnan(q) or q > 2.0**127:
        return 254
    if q <= 2.0**-127:
        return 0
    mantissa, exponent = math.frexp(q)  # q = mantissa * 2**exponent, mantissa in [0.5, 1)
    ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
    return ceil_log2 + 127


def mxfp8_plan(latent, block=32):
    """SPEC section 5 in float64: (values float8_e4m3fn [B, L], scale bytes uint8 [B, L / block])."""
    # A signalling NaN raises the invalid flag when cast; NaN stays NaN, as the SPEC's plan reads it.
    with np.errstate(invalid="ignore"):
        v = np.asarray(latent, BF16).astype(np.float64)
    rows, width = v.shape
    blocks = v.reshape(rows, width // block, block)
    amax = np.max(np.abs(blocks), axis=-1)
    scale_bytes = np.vectorize(lambda a: e8m0_byte(a / 448.0), otypes=[np.int64])(amax)
    inverse = np.where(scale_bytes == 0, 0.0, np.exp2(127.0 - scale_bytes))
    with np.errstate(invalid="ignore"):
        scaled = np.clip(blocks * inverse[..., None], -448.0, 448.0)
    values = scaled.reshape(rows, width).astype(ml_dtypes.float8_e4m3fn)
    return values, scale_bytes.astype(np.uint8)


def situ(gate, up, beta=4.0, linear_beta=25.0) -> np.ndarray:
    """SPEC section 6's activation in float64 on bfloat16 inputs, rounded to bfloat16."""
    g = np.asarray(gate, BF16).astype(np.float64)
    u = np.asarray(up, BF16).astype(np.float64)
    value = beta * np.tanh(g / beta) / (1.0 + np.exp(-g)) * linear_beta * np.tanh(u / linear_beta)
    return value.astype(BF16)


def shared_expert(x, gate_up, down, beta=4.0, linear_beta=25.0) -> np.ndarray:
    """SPEC section 6 in float64 with the SPEC's bfloat16 roundings of gate, up and hidden."""
    x64 = np.asarray(x, BF16).astype(np.float64)
    gu = np.asarray(gate_up, BF16).astype(np.float64)
    s = gu.shape[0] // 2
    h = x64 @ gu.T
    hidden = situ(h[:, :s].astype(BF16), h[:, s:].astype(BF16), beta, linear_beta)
    return hidden.astype(np.float64) @ np.asarray(down, BF16).astype(np.float64).T


def silu_shared_expert(x, gate_up, down) -> np.ndarray:
    """SPEC section 6 with ``activation = silu`` in float64, with the bfloat16 roundings of gate, up
    and hidden."""
    x64 = np.asarray(x, BF16).astype(np.float64)
    gu = np.asarray(gate_up, BF16).astype(np.float64)
    s = gu.shape[0] // 2
    h = x64 @ gu.T
    gate = h[:, :s].astype(BF16).astype(np.float64)
    up = h[:, s:].astype(BF16).astype(np.float64)
    hidden = (gate / (1.0 + np.exp(-gate)) * up).astype(BF16).astype(np.float64)
    return hidden @ np.asarray(down, BF16).astype(np.float64).T


def assert_valid_ids(ids, experts: int) -> None:
    """SPEC section 4's guarantee for any input: int32 ids in ``[0, experts)``, distinct per row."""
    ids = np.asarray(ids)
    assert ids.dtype == np.int32
    assert ((ids >= 0) & (ids < experts)).all()
    assert all(len(set(row)) == len(row) for row in ids.tolist())
