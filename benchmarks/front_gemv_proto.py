"""Prototype: the front GEMM at the smallest batches as a matrix-vector kernel (Pallas, Triton).

  python benchmarks/front_gemv_proto.py --out $OUT            (GPU: check against XLA, then time)
  python benchmarks/front_gemv_proto.py --interpret           (any machine: check in interpret mode)

Computes ``y[B, n] = x[B, K] @ W[n, K]^T`` (bf16 in, float32 out) for the packed front weight with
no tensor cores and no split of K: program ``p`` owns ``rows`` consecutive rows of ``W`` and streams
them over all of K in ``block_k`` steps that Triton's pipeliner keeps ``num_stages`` deep, keeping one
float32 accumulator ``[rows, block_k]`` per batch row (a multiply-add per weight element and batch
row) and summing it over K once at the end. So there are no partial tiles, no counters to zero and
no last-program reduction: the costs that the split-K and stream-K schedules pay at tp8 (where the
shard is too small for whole-K tiles of 16+ rows to cover 132 SMs) and that XLA's own GEMMs pay in a
reduction kernel. XLA runs the tp8 B=1 product the same way (one reduction kernel, 3.58 us,
benchmarks/RESULTS.md) and GEMMs from B=2 on.

The price is arithmetic on the CUDA cores: ``2 * B * n * K`` FLOP, 0.46 GFLOP per batch row at tp1
(7 us per row at an H200's 67 TFLOP/s of float32), so it can only pay for B of a few.

Status (2026-12-03): checked in interpret mode (``--interpret``) and lowered for an H200 from the
CPU host at every variant below; not yet run on a GPU.

Bytes per call: ``2 * n * K`` weight (K3 has no padding rows), ``2 * B * K`` of
``x`` per program from L2, ``4 * B * n`` out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@functools.partial(jax.jit, static_argnames=("rows", "block_k", "num_warps", "num_stages", "interpret"))
def gemv(x, w, *, rows, block_k, num_warps=4, num_stages=4, interpret=False):
    """``x [B, K] @ w [n, K]^T`` float32 ``[B, n]``, ``rows`` rows of ``w`` per program."""
    batch, hidden = x.shape
    n = w.shape[0]
    if hidden % block_k:
        raise ValueError(f"block_k={block_k} must divide K={hidden}")

    def kernel(x_ref, w_ref, y_ref):
        first = pl.program_id(0) * rows
        row_ok = first + lax.broadcasted_iota(jnp.int32, (rows,), 0) < n
        w_mask = None if n % rows == 0 else row_ok[:, None]

        def step(i, accs):
            k = pl.multiple_of(i * block_k, block_k)
            wt = plgpu.load(w_ref.at[pl.ds(first, rows), pl.ds(k, block_k)], mask=w_mask,
                            other=None if w_mask is None else 0.0,
                            eviction_policy="evict_first").astype(jnp.float32)
            return tuple(
                acc + wt * plgpu.load(x_ref.at[pl.ds(b, 1), pl.ds(k, block_k)]).astype(jnp.float32)
                for b, acc in enumerate(accs)
            )

        zeros = tuple(jnp.zeros((rows, block_k), jnp.float32) for _ in range(batch))
        accs = lax.fori_loop(0, hidden // block_k, step, zeros)
        for b, acc in enumerate(accs):
            plgpu.store(y_ref.at[jnp.int32(b), pl.ds(first, rows)], jnp.sum(acc, axis=1), mask=row_ok)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, n), jnp.float32),
        grid=(pl.cdiv(n, rows),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="front_gemv",
    )(x, w)


# (tp, rows, block_k, warps, stages): tp8's 560 packed rows over 140 or 70 programs, tp1's 4480 over
# 140 or 280.
VARIANTS = [
    (8, 4, 512, 4, 4), (8, 4, 1024, 4, 3), (8, 8, 256, 4, 6), (8, 8, 512, 8, 4),
    (1, 32, 128, 4, 6), (1, 32, 256, 8, 4), (1, 16, 256, 4, 6), (1, 16, 512, 8, 4),
]


def check(y, want) -> float:
    """The largest error relative to the row's largest value."""
    y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
    return float((np.abs(y - want) / (np.abs(want).max(axis=1, keepdims=True) + 1e-30)).max())


def run_interpret() -> None:
    rng = np.random.default_rng(0)
    for batch, n, hidden, rows, bk in ((1, 100, 256, 8, 64), (3, 64, 512, 16, 128), (4, 37, 128, 4, 32)):
        x = jnp.asarray(rng.standard_normal((batch, hidden)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, hidden)), jnp.bfloat16)
        got = gemv(x, w, rows=rows, block_k=bk, interpret=True)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        err = check(got, want)
        print(f"interpret B={batch} n={n} K={hidden} rows={rows} block_k={bk}: max error {err:.1e}")
        assert err < 1e-6, err


def run_gpu(out: str, batches: list[int]) -> None:
    from front_gemm_timing import Shape, cupti_us_per_call, decode_rows, packed_weights, xla_dot

    results = []
    for tp in sorted({v[0] for v in VARIANTS}):
        shape = Shape.k3(tp)
        weights = packed_weights(shape)
        for batch in batches:
            x = decode_rows(batch, shape.hidden)
            xla = jax.jit(xla_dot)
            xla_us, xla_kernels = cupti_us_per_call(xla, x, weights)
            want = xla(x, weights[0])
            for _, rows, bk, warps, stages in (v for v in VARIANTS if v[0] == tp):
                row = dict(tp=tp, batch=batch, rows=rows, block_k=bk, num_warps=warps,
                           num_stages=stages, xla_us=xla_us, xla_kernels=xla_kernels)
                try:
                    fn = jax.jit(functools.partial(gemv, rows=rows, block_k=bk, num_warps=warps,
                                                   num_stages=stages))
                    row["error"] = check(fn(x, weights[0]), want)
                    row["us"], row["kernels"] = cupti_us_per_call(fn, x, weights)
                except Exception as e:  # a variant that fails is recorded
                    row["failure"] = f"{type(e).__name__}: {str(e)[:300]}"
                results.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "front_gemv_proto.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, results=results), f, indent=1)
    print(f"\n{'tp':>3} {'B':>3} {'best us':>8} {'xla us':>7} {'xla/k':>6}  rows bk warps stages  error")
    for tp in sorted({r["tp"] for r in results}):
        for batch in batches:
            timed = [r for r in results if r["tp"] == tp and r["batch"] == batch and "us" in r]
            if timed:
                r = min(timed, key=lambda r: r["us"])
                print(f"{tp:>3} {batch:>3} {r['us']:>8.2f} {r['xla_us']:>7.2f} "
                      f"{r['xla_us'] / r['us']:>6.2f}  {r['rows']} {r['block_k']} {r['num_warps']} "
                      f"{r['num_stages']}  {r['error']:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args()
    if args.interpret:
        run_interpret()
    else:
        run_gpu(args.out, list(map(int, args.batches.split(","))))


if __name__ == "__main__":
    main()
