"""Prototype (not shipped; RESULTS.md has its figures): the routing step as a jax-triton kernel around
Triton's ``tl.topk`` (bitonic), timed beside the Pallas argmax kernel and the XLA reference on the
GPU, with its outputs checked against the Pallas kernel's bit for bit.

  python benchmarks/route_topk_proto.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.pallas import route as rt

NAN_KEY = tl.constexpr(rt.NAN_KEY)
PAD_KEY = tl.constexpr(rt.PAD_KEY)


@triton.jit
def _tree_sum(w, LOG_N: tl.constexpr):
    for i in tl.static_range(LOG_N):
        w = tl.sum(tl.reshape(w, (2 ** (LOG_N - i - 1), 2)), axis=1)
    return tl.sum(w, axis=0)


@triton.jit
def route_topk(logits, bias, ids_out, weights_out, E: tl.constexpr, LANES: tl.constexpr,
               K: tl.constexpr, LOG_K: tl.constexpr, SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, LANES)
    ok = lane < E
    x = tl.load(logits + row * E + lane, mask=ok, other=0.0)
    b = tl.load(bias + lane, mask=ok, other=0.0)
    s = libdevice.div_rn(1.0, 1.0 + libdevice.exp(-x))
    key = s + b
    bits = key.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ordered = tl.where(key != key, NAN_KEY, ordered)
    ordered = tl.where(ok, ordered, PAD_KEY)
    packed = (ordered.to(tl.int64) << 32) | (LANES - 1 - lane).to(tl.int64)
    top = tl.topk(packed, K)
    ids = (LANES - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    chosen = tl.load(logits + row * E + ids)
    w = libdevice.div_rn(1.0, 1.0 + libdevice.exp(-chosen))
    w = tl.where(w != w, 0.0, w)
    total = _tree_sum(w, LOG_K) + 1e-20
    out = libdevice.div_rn(w * SCALE, total)
    slot = tl.arange(0, K)
    tl.store(ids_out + row * K + slot, ids)
    tl.store(weights_out + row * K + slot, out.to(tl.bfloat16))


def route(logits, bias, cfg, num_warps=4):
    import jax_triton as jt

    batch = logits.shape[0]
    return jt.triton_call(
        logits, bias, kernel=route_topk,
        out_shape=[jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.int32),
                   jax.ShapeDtypeStruct((batch, cfg.top_k), jnp.bfloat16)],
        grid=(batch,), num_warps=num_warps, name="route_topk",
        E=cfg.experts, LANES=rt.next_power_of_2(cfg.experts), K=cfg.top_k,
        LOG_K=cfg.top_k.bit_length() - 1,
        SCALE=float(cfg.routed_scaling_factor),
    )


def main():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from front_gemm_timing import cupti_us_per_call
    from test_route_kernel import edge_rows

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cfg = mf.KIMI_K3
    assert cfg.renormalize
    bias = jax.random.uniform(jax.random.key(3), (cfg.experts,), jnp.float32, -0.05, 0.05)
    results = {}
    # Bit-equal to the Pallas kernel (same sigmoid) on random and edge rows.
    rows = jnp.concatenate([jnp.asarray(edge_rows(cfg.experts)),
                            jax.random.normal(jax.random.key(9), (4096, cfg.experts)) * 2])
    want = jax.jit(lambda l, b: rt.route(l, b, cfg))(rows, bias)
    for w in (1, 2, 4, 8):
        got = jax.jit(lambda l, b: route(l, b, cfg, w))(rows, bias)
        same = [bool(jnp.array_equal(g, x)) for g, x in zip(got, want)]
        print(f"topk w{w}: ids equal {same[0]}, weights equal {same[1]}", flush=True)
        results[f"equal_w{w}"] = same
    for batch in (1, 8, 64, 256):
        logits = [jax.random.normal(k, (batch, cfg.experts)) * 2
                  for k in jax.random.split(jax.random.key(batch), 16)]
        row = {}
        fns = {"pallas": lambda b, l: rt.route(l, b, cfg), "xla": lambda b, l: reference.route(l, b, cfg)}
        for w in (1, 2, 4, 8):
            fns[f"topk_w{w}"] = (lambda w: lambda b, l: route(l, b, cfg, w))(w)
        for name, fn in fns.items():
            compiled = jax.jit(fn).lower(bias, logits[0]).compile()
            row[name] = round(cupti_us_per_call(compiled, bias, logits, rounds=8)[0], 3)
        results[batch] = row
        print(json.dumps({"batch": batch, **row}), flush=True)
    with open(os.path.join(args.out, "route_topk_proto.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
