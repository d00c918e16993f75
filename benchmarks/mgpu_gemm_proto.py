"""Prototype: a Mosaic GPU (``plgpu.kernel``) weight-streaming front GEMM, timed beside XLA and Triton.

  python benchmarks/mgpu_gemm_proto.py --reduce direct --baselines --out $OUT   (GPU: check + time)
  python benchmarks/mgpu_gemm_proto.py --reduce xla --out $OUT        (one process per reduction,
  python benchmarks/mgpu_gemm_proto.py --reduce sem --out $OUT         so a hang costs only its own)
  python benchmarks/mgpu_gemm_proto.py --table --out $OUT             (merge the JSON, print tables)
  python benchmarks/mgpu_gemm_proto.py --lower-only        (CPU host: lower every variant for an H200)

Computes ``y[B, n] = x[B, K] @ W[n, K]^T`` (bf16 in, float32 accumulation) for the packed front
weight ``W = [router rows; latent rows]`` and returns float32 logits ``y[:, :valid]`` and the bf16
latent ``y[:, split:]``.

Schedule (decode: bound by reading ``W``). A/B are swapped: a 64-row tile of the weight is wgmma's M
operand and the batch, padded to ``Bp`` (a multiple of 8, at most 256), is N, so the accumulator is
``y^T`` tile ``[64, Bp]`` float32 in one warpgroup's registers. The grid is ``(split_k, tiles)``: each
CTA streams its ``[64, H / split_k]`` slab of ``W`` (and the matching ``[Bp, H / split_k]`` of ``x``)
through ``emit_pipeline``'s ring of ``depth`` TMA stages of ``block_k`` columns. Rows past ``n`` and
batch rows past ``B`` are TMA out-of-bounds reads (zero filled), never written back by the epilogue.

Split-K reduction, three variants:
  ``xla``: every CTA writes its float32 partial ``[64, Bp]`` (smem, then a TMA store) to
    ``partials[split_k, tiles * 64, Bp]``; XLA sums over ``split_k``, transposes, slices and casts.
  ``sem``: CTAs of part > 0 write their partial, then signal the tile's semaphore (a release
    reduction); the part-0 CTA of the tile waits for ``split_k - 1`` signals, TMA-loads the partials,
    adds them to its accumulator in a fixed order and writes ``y^T [tiles * 64, Bp]`` float32; XLA
    transposes, slices and casts. ``pl.get_global`` semaphores are lowered (jax 0.11.2) as a GMEM
    scratch that XLA zeroes before every call (a ``loop_broadcast_fusion`` kernel), not as
    persistent memory.
  ``direct``: not swapped (the batch, padded to 64, is M), the same semaphore reduction, and the
    part-0 CTA TMA-stores float32 logits and bf16 latent tiles straight into the outputs: one
    Mosaic GPU kernel (plus the semaphore zeroing). The swapped orientation cannot do this: storing a
    float32 WGMMA accumulator through a transposed smem view fails Mosaic GPU's layout inference in
    jax 0.11.2 ("Failed to infer a possible set of layouts"); a bf16 one lowers.

Measured on the H200 (2026-12-03, CUPTI, rotated weights; the table is in benchmarks/RESULTS.md): the swapped GEMM alone streams at 3.75-3.78 TB/s at tp1, B <= 8 (17.0-17.2 us; XLA's dot
19.1-20.9 us) and takes 3.81 us at tp8, B <= 8 (XLA 4.6-6.4 us); the reductions then add 2-5 us, so
end to end it beats both XLA's dot and the Triton kernel only at tp8 B=8 and tp1 B=1.

Bytes per call: ``2 * rows * H`` weight (the rows of the last partial tile included), ``2 * Bp * H *
tiles`` of ``x`` from L2, ``4 * 64 * Bp * tiles * split_k`` partials written (and read back).
FLOPs: ``2 * Bp * tiles * 64 * H`` on the tensor cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS_PER_TILE = 64  # one warpgroup's wgmma M


@dataclasses.dataclass(frozen=True)
class Config:
    """Schedule of one call: K columns per TMA stage, ring depth, K split, reduction variant."""

    block_k: int
    depth: int
    split_k: int
    reduce: str  # "xla" or "sem"

    def __str__(self):
        return f"k{self.block_k}d{self.depth}s{self.split_k}{self.reduce}"


def padded_batch(batch: int) -> int:
    if not 1 <= batch <= 256:
        raise ValueError(f"batch must be in 1..256, got {batch}")
    return -(-batch // 8) * 8


def _transforms(block_k: int):
    swizzle = plgpu.find_swizzle(block_k * 16)  # bf16: 16 bits an element
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _stream(x_gmem, w_gmem, cfg: Config, bp: int, part, tile, swap: bool = True):
    """The CTA's float32 accumulator over its K chunk (a FragmentedArray): ``y^T`` tile ``[64, bp]``
    (``swap``: the weight is wgmma's M operand) or ``y`` tile ``[bp, 64]`` (the batch is M; ``bp`` a
    multiple of 64, rows past the batch zero-filled by TMA and never read from HBM)."""
    hidden = w_gmem.shape[1]
    steps = hidden // cfg.split_k // cfg.block_k
    transforms = _transforms(cfg.block_k)

    def scope(acc_ref):
        def body(_, w_smem, x_smem):
            if swap:
                plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0)))
            else:
                plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
            plgpu.wgmma_wait(1)  # the previous step's stage may now be refilled

        plgpu.emit_pipeline(
            body,
            grid=(steps,),
            in_specs=[
                plgpu.BlockSpec((ROWS_PER_TILE, cfg.block_k), lambda k: (tile, part * steps + k),
                                transforms=transforms, delay_release=1),
                plgpu.BlockSpec((bp, cfg.block_k), lambda k: (0, part * steps + k),
                                transforms=transforms, delay_release=1),
            ],
            max_concurrent_steps=cfg.depth,
        )(w_gmem, x_gmem)
        return acc_ref[...]

    shape = (ROWS_PER_TILE, bp) if swap else (bp, ROWS_PER_TILE)
    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _store_tile(value, dst_gmem):
    """Registers -> smem -> TMA store of one ``[64, Bp]`` float32 tile; waits until it is written."""

    def scope(smem):
        smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, dst_gmem)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM(value.shape, jnp.float32))


def _store_out(value, dst_gmem, dtype):
    """A finished ``[bp, 64]`` float32 tile cast to ``dtype`` -> smem -> TMA store (rows past the
    batch and columns past the output are clipped by TMA)."""

    def scope(smem):
        smem[...] = value.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, dst_gmem)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM(value.shape, dtype))


def _proxy_fence():
    """``fence.proxy.async.global``: orders this thread's generic-proxy accesses of global memory
    with its TMA (async-proxy) ones, on both sides of the semaphore handshake."""

    @plgpu.inline_mgpu()
    def _(ctx):
        mgpu_utils.inline_ptx("fence.proxy.async.global;", result_types=None, has_side_effects=True)


def _reduce_in_kernel(acc, parts_gmem, part, tile, s, tiles, finish, swap=True):
    """Part > 0: write the partial and signal the tile's semaphore; part 0: wait for the others, add
    their partials in part order to ``acc`` and call ``finish(total)``. The semaphores are
    ``pl.get_global`` ones; the wait decrements them back to 0."""
    if s == 1:
        return finish(acc)
    rows_slice = pl.ds(tile * ROWS_PER_TILE, ROWS_PER_TILE)
    at = (lambda p: parts_gmem.at[p, rows_slice]) if swap else (lambda p: parts_gmem.at[p, :, rows_slice])
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((tiles,)))

    @pl.when(part > 0)
    def _():
        _store_tile(acc, at(part - 1))
        _proxy_fence()
        plgpu.semaphore_signal(sems.at[tile], memory_scope="gpu")

    @pl.when(part == 0)
    def _():
        plgpu.semaphore_wait(sems.at[tile], s - 1, memory_scope="gpu")
        _proxy_fence()

        def scope(buf, barrier):
            def fetch(p):
                plgpu.copy_gmem_to_smem(at(p), buf.at[p % 2],
                                        barrier.at[p % 2])

            fetch(0)
            total = acc
            for p in range(s - 1):  # fixed order: results do not depend on arrival
                if p + 1 < s - 1:
                    fetch(p + 1)
                plgpu.barrier_wait(barrier.at[p % 2])
                total = total + buf[p % 2]
            finish(total)

        pl.run_scoped(scope, plgpu.SMEM((2, *acc.shape), jnp.float32),
                      plgpu.Barrier(num_barriers=2))


def gemm_t(x, w, cfg: Config):
    """``y^T`` (``sem``: ``[tiles * 64, Bp]``) or the partials (``xla``: ``[split_k, tiles * 64, Bp]``),
    float32, of ``x [B, K] @ w [n, K]^T``."""
    batch, hidden = x.shape
    rows, hidden_w = w.shape
    if hidden != hidden_w or hidden % (cfg.split_k * cfg.block_k):
        raise ValueError(f"hidden {hidden} (w: {hidden_w}) must split into {cfg.split_k} x {cfg.block_k}")
    bp = padded_batch(batch)
    tiles = -(-rows // ROWS_PER_TILE)
    s = cfg.split_k
    rows_out = tiles * ROWS_PER_TILE

    if cfg.reduce == "xla":
        def kernel(x_gmem, w_gmem, parts_gmem):
            part, tile = lax.axis_index("part"), lax.axis_index("tile")
            acc = _stream(x_gmem, w_gmem, cfg, bp, part, tile)
            _store_tile(acc, parts_gmem.at[part, pl.ds(tile * ROWS_PER_TILE, ROWS_PER_TILE)])

        out_type = jax.ShapeDtypeStruct((s, rows_out, bp), jnp.float32)
    elif cfg.reduce == "sem":
        def kernel(x_gmem, w_gmem, y_gmem, parts_gmem):
            part, tile = lax.axis_index("part"), lax.axis_index("tile")
            acc = _stream(x_gmem, w_gmem, cfg, bp, part, tile)
            finish = lambda total: _store_tile(
                total, y_gmem.at[pl.ds(tile * ROWS_PER_TILE, ROWS_PER_TILE)])
            _reduce_in_kernel(acc, parts_gmem, part, tile, s, tiles, finish)

        out_type = (jax.ShapeDtypeStruct((rows_out, bp), jnp.float32),
                    jax.ShapeDtypeStruct((max(s - 1, 1), rows_out, bp), jnp.float32))
    else:
        raise ValueError(f"reduce must be 'xla', 'sem' or 'direct', got {cfg.reduce!r}")

    call = plgpu.kernel(kernel, out_type=out_type, grid=(s, tiles), grid_names=("part", "tile"))
    out = call(x, w)
    return out if cfg.reduce == "xla" else out[0]


def front_gemm_direct(x, w, split: int, valid: int, cfg: Config):
    """The ``direct`` variant: one kernel writes logits and latent (no XLA epilogue). Not swapped:
    the batch, padded to 64 (TMA zero-fills the missing rows), is wgmma's M and a 64-row weight tile
    is N, so the finished tile is already ``y``'s ``[batch, rows]`` orientation (Mosaic GPU in jax
    0.11.2 cannot store a float32 WGMMA accumulator through a transposed smem view). Router tiles
    cover rows ``[0, valid)`` (the last one may read latent rows; its store is clipped at ``valid``),
    latent tiles start at ``split``."""
    batch, hidden = x.shape
    rows = w.shape[0]
    shard = rows - split
    mp = -(-batch // 64) * 64
    if mp > 128:
        raise ValueError(f"the direct variant takes batch <= 128, got {batch}")
    router_tiles = -(-valid // ROWS_PER_TILE)
    tiles = router_tiles + -(-shard // ROWS_PER_TILE)
    s = cfg.split_k

    def kernel(x_gmem, w_gmem, logits_gmem, latent_gmem, parts_gmem):
        part, tile = lax.axis_index("part"), lax.axis_index("tile")
        is_latent = tile >= router_tiles
        first_row = jnp.where(is_latent, split + (tile - router_tiles) * ROWS_PER_TILE,
                              tile * ROWS_PER_TILE)
        w_tile = w_gmem.at[pl.ds(first_row, ROWS_PER_TILE)]
        acc = _stream(x_gmem, w_tile, cfg, mp, part, 0, swap=False)

        def finish(total):
            @pl.when(jnp.logical_not(is_latent))
            def _():
                _store_out(total, logits_gmem.at[pl.ds(0, mp), pl.ds(first_row, ROWS_PER_TILE)],
                           jnp.float32)

            @pl.when(is_latent)
            def _():
                column = first_row - split
                _store_out(total, latent_gmem.at[pl.ds(0, mp), pl.ds(column, ROWS_PER_TILE)],
                           jnp.bfloat16)

        _reduce_in_kernel(acc, parts_gmem, part, tile, s, tiles, finish, swap=False)

    out_type = (jax.ShapeDtypeStruct((batch, valid), jnp.float32),
                jax.ShapeDtypeStruct((batch, shard), jnp.bfloat16),
                jax.ShapeDtypeStruct((max(s - 1, 1), mp, tiles * ROWS_PER_TILE), jnp.float32))
    call = plgpu.kernel(kernel, out_type=out_type, grid=(s, tiles), grid_names=("part", "tile"))
    logits, latent, _ = call(x, w)
    return logits, latent


def front_gemm(x, w, split: int, valid: int, cfg: Config):
    """``(logits [B, valid] float32, latent [B, rows - split] bf16)`` through the Mosaic GPU kernel."""
    if cfg.reduce == "direct":
        return front_gemm_direct(x, w, split, valid, cfg)
    batch = x.shape[0]
    yt = gemm_t(x, w, cfg)
    if cfg.reduce == "xla":
        yt = yt.sum(0)
    y = yt.T[:batch, : w.shape[0]]
    return y[:, :valid], y[:, split:].astype(jnp.bfloat16)


# ------------------------------------------------------------------------------------------------
# Driver

SHAPES = {1: (896, 3584), 8: (112, 448)}  # tp -> (valid, shard) for K3, hidden 7168
HIDDEN = 7168


def variants(tp: int, reduces=("xla", "sem", "direct")) -> list[Config]:
    """The schedules the run times: K splits that put the 9 (tp8) or 70 (tp1) row tiles on the 132
    SMs (tp8: 63 or 126 CTAs; tp1: 140 or 280), 64- or 128-column stages, ring depth 4-8."""
    schedules = {1: ((128, 4, 2), (128, 6, 2), (128, 4, 4)),
                 8: ((128, 4, 7), (128, 4, 14), (64, 8, 14))}[tp]
    return [Config(block_k, depth, s, reduce)
            for reduce in reduces for block_k, depth, s in schedules]


def lower_only(tps, batches) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from h200 import lower_for_h200

    from moe_front_jax import params as mfp

    failures = 0
    for tp in tps:
        valid, shard = SHAPES[tp]
        split = mfp.padded_split(valid)
        w = jnp.zeros((split + shard, HIDDEN), jnp.bfloat16)
        for batch in batches:
            x = jnp.zeros((batch, HIDDEN), jnp.bfloat16)
            for cfg in variants(tp):
                try:
                    lower_for_h200(functools.partial(front_gemm, split=split, valid=valid, cfg=cfg), x, w)
                    print(f"tp{tp} B={batch} {cfg}: lowered", flush=True)
                except Exception as e:  # report every variant's failure, keep going
                    failures += 1
                    print(f"tp{tp} B={batch} {cfg}: {type(e).__name__}: {str(e)[:600]}", flush=True)
    print(f"{failures} failures")


def measure(tps, batches, reduces, baselines: bool, out: str) -> None:
    """Check and time every variant of ``reduces`` (and XLA's dot and the Triton kernel when
    ``baselines``) at each (tp, B); rows go to ``out/mgpu_gemm_proto_<reduces>.json`` as they finish."""
    from front_gemm_timing import Shape, cupti_us_per_call, decode_rows, packed_weights, xla_dot

    from moe_front_jax.pallas import front_gemm as fg

    device = jax.devices()[0]
    start = time.time()
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), reduces, flush=True)
    path = os.path.join(out, f"mgpu_gemm_proto_{'_'.join(reduces)}.json")
    rows, errors = [], []
    for tp in tps:
        shape = Shape.k3(tp)
        weights = packed_weights(shape)
        w0 = weights[0]
        for batch in batches:
            x = decode_rows(batch, shape.hidden)
            exact = np.asarray(x, np.float64) @ np.asarray(w0, np.float64).T
            want_logits, want_latent = exact[:, : shape.valid], exact[:, shape.split:]
            fns = {}
            if baselines:
                fns["xla_dot"] = xla_dot
                fns["triton"] = lambda x, w: fg.front_gemm(x, w, shape.split, shape.valid)
            for cfg in variants(tp, reduces):
                fns[f"{cfg}"] = functools.partial(front_gemm, split=shape.split, valid=shape.valid,
                                                  cfg=cfg)
                if cfg.reduce == "xla":
                    fns[f"{cfg}:gemm"] = functools.partial(gemm_t, cfg=cfg)
            row = dict(tp=tp, batch=batch, floor_us=shape.floor_us())
            for name, fn in fns.items():
                t0 = time.time()
                try:
                    fn = jax.jit(fn).lower(x, w0).compile()
                    if ":" not in name and name != "xla_dot":
                        logits, latent = jax.block_until_ready(fn(x, w0))
                        # tests/test_front_gemm_kernel.py's bound: each value's magnitude is taken
                        # at least at its row's RMS (fp32 accumulation in any order cannot give
                        # entries near zero a relative bound); a bf16 ulp is 2^(floor(log2 m) - 7)
                        mag = np.maximum(np.abs(exact), np.sqrt((exact**2).mean(1, keepdims=True)))
                        err = float(np.max(np.abs(np.asarray(logits, np.float64) - want_logits)
                                           / mag[:, : shape.valid]))
                        lat = np.asarray(latent.astype(jnp.float32), np.float64)
                        ulps = 2.0 ** (np.floor(np.log2(mag[:, shape.split:])) - 7)
                        ulp = float(np.max(np.abs(lat - want_latent) / ulps))
                        row[name + ":err"] = err
                        row[name + ":latent_ulp"] = ulp
                        row[name + ":ok"] = err <= 1e-5 and ulp <= 1
                        if not row[name + ":ok"]:
                            errors.append(f"tp{tp} B={batch} {name}: logits rel {err:.2e}, latent "
                                          f"{ulp:.2f} ulp")
                    t1 = time.time()
                    row[name], kernels = cupti_us_per_call(fn, x, weights)
                    row[name + ":kernels"] = kernels
                    print(f"  [{time.time() - start:5.1f}s] tp{tp} B={batch} {name}: {row[name]:.2f} us"
                          f" (compile+check {t1 - t0:.1f}s)", flush=True)
                except Exception as e:  # one failed variant must not stop the others
                    row[name] = None
                    row[name + ":error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"tp{tp} B={batch} {name}: {row[name + ':error']}", flush=True)
            rows.append(row)
            with open(path, "w") as f:
                json.dump(dict(device=device.device_kind, rows=rows, errors=errors), f, indent=1)
    print("errors:", errors or "none", flush=True)


def table(out: str) -> None:
    """Merge ``out/mgpu_gemm_proto_*.json`` by (tp, B) and print the comparison and every variant."""
    import glob

    from front_gemm_timing import Shape, tbs

    merged, errors, device = {}, [], None
    for path in sorted(glob.glob(os.path.join(out, "mgpu_gemm_proto_*.json"))):
        with open(path) as f:
            data = json.load(f)
        device = data["device"]
        errors += data["errors"]
        for r in data["rows"]:
            merged.setdefault((r["tp"], r["batch"]), {}).update(r)
    rows = [merged[k] for k in sorted(merged, key=lambda k: (-k[0], k[1]))]
    with open(os.path.join(out, "mgpu_gemm_proto.json"), "w") as f:
        json.dump(dict(device=device, rows=rows, errors=errors), f, indent=1)
    print("\nerrors:", errors or "none")
    nan = float("nan")

    def best(r, reduce):
        cands = [(r[str(c)], str(c)) for c in variants(r["tp"], (reduce,))
                 if r.get(str(c)) is not None and r.get(str(c) + ":ok")]
        return min(cands) if cands else (nan, "-")

    print(f"\n{device}: Mosaic GPU prototype against XLA's dot and the Triton front_gemm (CUPTI us "
          "per call, weights rotated past L2; end to end = f32 logits + bf16 latent)")
    print(f"{'tp':>3} {'B':>4} {'floor':>6} {'xla dot':>8} {'triton':>7} | {'direct':>7} {'schedule':>15} "
          f"| {'sem':>6} | {'xla-red':>7} {'(gemm)':>6} | {'TB/s':>5} {'xla/best':>8} {'triton/best':>11}")
    for r in rows:
        d_us, d_name = best(r, "direct")
        s_us, _ = best(r, "sem")
        x_us, x_name = best(r, "xla")
        b_us = min(d_us, s_us, x_us)
        nbytes = Shape.k3(r["tp"]).weight_bytes
        xla, tri = r.get("xla_dot") or nan, r.get("triton") or nan
        print(f"{r['tp']:>3} {r['batch']:>4} {r['floor_us']:>6.2f} {xla:>8.2f} {tri:>7.2f} | "
              f"{d_us:>7.2f} {d_name:>15} | {s_us:>6.2f} | {x_us:>7.2f} "
              f"{r.get(x_name + ':gemm') or nan:>6.2f} | {tbs(nbytes, b_us):>5.2f} {xla / b_us:>8.2f} "
              f"{tri / b_us:>11.2f}")
    print("\nall variants (us: end to end, /gemm alone for xla-red; * = failed or missed the check):")
    for r in rows:
        cells = []
        for c in variants(r["tp"]):
            e2e, gemm = r.get(str(c)), r.get(str(c) + ":gemm")
            cell = f"{c}={e2e:.2f}" if e2e is not None else f"{c}=none"
            if gemm is not None:
                cell += f"/{gemm:.2f}"
            cells.append(cell + ("" if r.get(str(c) + ":ok") else "*"))
        print(f"tp{r['tp']} B={r['batch']}: " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tps", default="8,1")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--reduce", default="direct,xla,sem")
    parser.add_argument("--baselines", action="store_true", help="also time XLA's dot and Triton")
    parser.add_argument("--lower-only", action="store_true")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    tps, batches = list(map(int, args.tps.split(","))), list(map(int, args.batches.split(",")))
    if args.lower_only:
        return lower_only(tps, batches)
    if args.table:
        return table(args.out)
    os.makedirs(args.out, exist_ok=True)
    measure(tps, batches, tuple(args.reduce.split(",")), args.baselines, args.out)


if __name__ == "__main__":
    main()
