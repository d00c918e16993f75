"""Regenerate the shared expert's tuning table on the GPU: pallas/tuning/<device kind>/shared_expert.json.

For each tp shape of K3 and batch rounded up to a power of two it compiles a pruned set of schedules
for each of the two kernels (gate/up with situ; down; up to B = 8 the vector schedules too), checks
each against XLA on the same data, times the correct ones with CUPTI over weights rotated past the
L2, and keeps the fastest pair (a call's time is the sum of its kernels'). XLA's references and the
schedules the keys run now are compiled and timed first, every one of them; ``--budget-s`` then
bounds the candidates. A TMA gate/up that splits K (not ``batch_m``) hands ``shared_expert``'s
Triton down ``hidden`` transposed (``gate_up_situ_t``, then ``down_proj_t``), so it is timed so,
and the grid downs are timed on ``hidden.T`` too (``down_t``): such a gate/up pairs
with the best ``down_t``, any other with the best down. Each kernel's XLA counterpart (the check's
reference) is timed in the same run.

  python benchmarks/tune_shared_expert.py --out $OUT [--table pallas/tuning/nvidia-h200/shared_expert.json]
  python benchmarks/tune_shared_expert.py --batches 1,2 --merge --table ...   (add keys to a table)
  python benchmarks/tune_shared_expert.py --schedules tma --merge --table ...

``--schedules`` picks the kinds of schedule timed (``grid``: split-K over a grid of tiles,
``vector``, ``tma``: Mosaic GPU's TMA ring into wgmma at B <= 64); each table entry names the
implementation of each kernel (``gemm.schedule.config_to_json``); the schedules a key runs now (its ``--table``
entry, or the heuristic's where it has none) are timed beside them, so that a merge keeps them
unless a candidate beats them in the same run.

Prints one line per (tp, batch) last; the full results go to $OUT/tune_shared_expert.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
import traceback
from math import nan

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax import reference
from moe_front_jax.pallas import shared_expert as se
from moe_front_jax.pallas.device import kind_folder
from moe_front_jax.pallas.gemm.schedule import (
    VECTOR_MAX_BATCH,
    GridConfig,
    VectorConfig,
    config_from_json,
    config_to_json,
    padded_batch,
)
from moe_front_jax.pallas.shared_expert import tma as shared_expert_tma
from moe_front_jax.pallas.shared_expert import triton as shared_expert_triton
from moe_front_jax.pallas.shared_expert.kernel import KERNEL_CONFIGS, KernelConfig
from moe_front_jax.pallas.shared_expert.tma import TMA_MAX_BATCH, TMA_ROWS, TmaConfig
from timing import (
    TUNE_SMEM_BUDGET, SharedShape, config_label, cupti_us_per_call, divisors, down_copies,
    gate_up_copies, rows, tbs, vector_schedules, xla_dot,
)

KINDS = ("grid", "vector", "tma")


def hands_over_transposed(c: KernelConfig | None) -> bool:
    """A gate/up schedule after which ``shared_expert`` gives the Triton down ``hidden.T``: the
    TMA gate/up with K split, whose partials lie batch-minor (not ``batch_m``'s)."""
    return isinstance(c, TmaConfig) and c.split_k > 1 and not c.batch_m


def transposed(h: jax.Array) -> jax.Array:
    """``hidden.T`` as ``down_proj_t`` runs on it: ``[S_r, batch tile]``, zero columns past B
    (``down_proj_t`` pads ``gate_up_situ_t``'s ``[S_r, Bp]`` so, in the XLA fusion that produces
    it: a padded input keeps that pad out of the down's time here)."""
    batch = h.shape[0]
    return jnp.pad(h.T, ((0, 0), (0, padded_batch(batch) - batch)))


def out_dtype(tp: int):
    """The down kernel's output as ``moe_front`` asks for it: bfloat16 at tp1, the float32 partial
    sum under tp."""
    return jnp.bfloat16 if tp == 1 else jnp.float32


XLA = {
    "gate_up": lambda tp: lambda x, w: reference.situ(
        *(reference.round_to_bfloat16(y) for y in jnp.split(xla_dot(x, w), 2, axis=1)), 4.0, 25.0),
    "down": lambda tp: lambda h, w: xla_dot(h, w).astype(out_dtype(tp)),
}
"""Each kernel's XLA counterpart at a tp: the check's reference, and timed beside the candidates."""


def candidates(row_count: int, k: int, parts: int, bp: int, cores: int = 132) -> list[GridConfig]:
    """Schedules worth timing for one kernel: rows per program 16, 32, 64, 128 (``parts`` row blocks
    each); K steps of 64, 128 and 256, and 16 and 32 for batch tiles of 64 and more (whose ``x``
    tile is as wide as the weight's); no split where the tiles alone give every SM a program, else the smallest split
    that does, the smallest that gives two, and the one of at most four programs per SM whose last
    wave is the fullest; the deepest pipeline that fits."""
    out = []
    for bn in (16, 32, 64, 128):
        tiles = -(-row_count // bn)
        for bk in (16, 32, 64, 128, 256) if bp >= 64 else (64, 128, 256):
            if k % bk:
                continue
            steps = k // bk
            splits = [s for s in divisors(steps) if steps // s >= 2]
            chosen = []
            for target in (cores, 2 * cores):
                fit = [s for s in splits if tiles * s >= target]
                if fit and fit[0] not in chosen:
                    chosen.append(fit[0])
            waves = [s for s in splits if cores <= tiles * s <= 4 * cores]
            if waves:
                fullest = max(waves, key=lambda s: tiles * s / (-(-tiles * s // cores) * cores))
                chosen += [fullest] if fullest not in chosen else []
            chosen = chosen or splits[-1:]
            warps = 4 if parts * bn * bp <= 64 * 64 else 8
            deepest = min(6, TUNE_SMEM_BUDGET // (2 * bk * (parts * bn + bp)))
            for s in chosen:
                depth = min(deepest, steps // s)
                if depth >= 2:
                    out.append(GridConfig(bn, bk, s, warps, depth))
    return list(dict.fromkeys(out))


def tma_candidates(row_count: int, k: int, parts: int, batch: int, cores: int = 132
                   ) -> list[TmaConfig]:
    """The TMA schedules worth timing for one kernel at a batch of at most 64: 64-row CTAs (per
    part), and from B = 8 on also ``batch_m`` CTAs of each multiple of 8 from 32 to 64 that divides
    the rows (tp1: 48 gate rows make 128 CTAs, 56 down rows 128), with stages of 64, 128 and 256
    columns; no split of K where the row tiles give two thirds of the ``cores`` SMs a CTA, else each
    split that gives them 96 to 300 CTAs of at least two K steps (XLA then sums the partials); rings
    3 to 8 deep (fewer where a CTA has fewer K steps) that fit the shared memory budget (``parts``
    weight blocks and the ``x`` block per stage: ``Bp`` rows, or ``TMA_MAX_BATCH`` with
    ``batch_m``)."""
    if batch > TMA_MAX_BATCH:
        return []
    bp = shared_expert_tma.tma_batch_rows(batch)
    shapes = [(TMA_ROWS, False)] if row_count % TMA_ROWS == 0 else []
    if batch >= 8:
        shapes += [(bn, True) for bn in range(32, TMA_ROWS + 1, 8) if row_count % bn == 0]
    out = []
    for bn, batch_m in shapes:
        tiles = row_count // bn
        for bk in (64, 128, 256):
            if k % bk:
                continue
            steps = k // bk
            splits = ([1] if 3 * tiles >= 2 * cores else
                      [s for s in divisors(steps) if 96 <= tiles * s <= 300 and steps // s >= 2])
            stage = 2 * bk * (parts * bn + (TMA_MAX_BATCH if batch_m else bp))
            for split in splits:
                deepest = min(TUNE_SMEM_BUDGET // stage, steps // split)
                for depth in sorted({d for d in (3, 4, 6, 8, deepest)
                                     if min(3, deepest) <= d <= deepest}):
                    out.append(TmaConfig(bn, bk, split, depth, batch_m=batch_m))
    return out


def vector_candidates(row_count: int, k: int, parts: int, batch: int) -> list[VectorConfig]:
    """The vector schedules worth timing for one kernel (``timing.vector_schedules``)."""
    return [VectorConfig(bn, bk, warps)
            for bn, bk, warps in vector_schedules(lambda bn: -(-row_count // bn), k, parts, batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--table", default=None, help="write the table here")
    parser.add_argument("--merge", action="store_true",
                        help="keep the --table file's entries for the keys this run does not tune")
    parser.add_argument("--tps", default="1,8")
    parser.add_argument("--batches", default="1,2,4,8,16,64")
    parser.add_argument("--budget-s", type=float, default=100.0,
                        help="seconds for the candidates, counted once XLA's references and the "
                             "schedules the keys run now are timed (those always are)")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--schedules", default=",".join(KINDS),
                        help="comma-separated kinds of schedule to time: " + ", ".join(KINDS))
    args = parser.parse_args()
    kinds = set(args.schedules.split(","))
    if not kinds <= set(KINDS):
        raise SystemExit(f"--schedules takes {', '.join(KINDS)}, got {args.schedules!r}")
    # The table's entries (or the heuristic's schedules), timed again beside the candidates.
    current = json.load(open(args.table))["entries"] if args.table and os.path.exists(args.table) else {}
    start = time.time()
    device = jax.devices()[0]
    kind = device.device_kind
    print("device", kind, "cores", getattr(device, "core_count", None), flush=True)
    shapes = {tp: SharedShape(tp) for tp in map(int, args.tps.split(","))}
    batches = list(map(int, args.batches.split(",")))

    weights, data, refs = {}, {}, {}
    for tp, s in shapes.items():
        weights[tp, "gate_up"], weights[tp, "down"] = gate_up_copies(s), down_copies(s)
        for bp in batches:
            x, h = rows(bp, s.hidden), rows(bp, s.shared, seed=3)
            data[tp, bp, "gate_up"], data[tp, bp, "down"] = x, h
            for kernel in ("gate_up", "down"):
                refs[tp, bp, kernel] = XLA[kernel](tp)(data[tp, bp, kernel], weights[tp, kernel][0])

    per_key, running = [], {}  # running: (tp, batch) -> the schedules the key runs now
    for tp, s in shapes.items():
        for bp in batches:
            tile = padded_batch(bp)
            entry = current.get(se.table_key(s.shared, s.hidden, bp))
            now = (se.SharedExpertConfig.from_json(entry) if entry
                   else se.heuristic_config(s.shared, s.hidden, bp, cores=132))
            running[tp, bp] = (now.gate_up, now.down)
            by_kernel = {}
            for kernel, row_count, k, parts in (("gate_up", s.shared, s.hidden, 2),
                                                ("down", s.hidden, s.shared, 1)):
                configs = [None, getattr(now, kernel)]  # None: XLA's, timed as the reference
                if "grid" in kinds:
                    configs += candidates(row_count, k, parts, tile)
                if "vector" in kinds and bp <= VECTOR_MAX_BATCH:
                    configs += vector_candidates(row_count, k, parts, bp)
                if "tma" in kinds:
                    configs += tma_candidates(row_count, k, parts, bp)
                by_kernel[kernel] = list(dict.fromkeys(configs))
            if any(map(hands_over_transposed, by_kernel["gate_up"])):
                by_kernel["down_t"] = [c for c in by_kernel["down"]
                                       if isinstance(c, GridConfig)]
            per_key += [[(tp, bp, kernel, c) for c in configs]
                        for kernel, configs in by_kernel.items()]
    jobs = [lst[i] for i in range(max(map(len, per_key))) for lst in per_key if i < len(lst)]
    print(f"{len(jobs)} variants", flush=True)

    def operands(tp, bp, kernel):
        """The job's input rows and weight copies (``down_t``: ``hidden.T`` and down's)."""
        if kernel == "down_t":
            return transposed(data[tp, bp, "down"]), weights[tp, "down"]
        return data[tp, bp, kernel], weights[tp, kernel]

    def compile_one(job):
        tp, bp, kernel, c = job
        if c is None:
            fn = XLA[kernel](tp)
        elif kernel == "gate_up" and hands_over_transposed(c):
            fn = lambda x, w: shared_expert_tma.gate_up_situ_t(x, w, 4.0, 25.0, config=c)  # noqa: E731
        elif kernel == "down_t":
            fn = lambda h_t, w: shared_expert_triton.down_proj_t(  # noqa: E731
                h_t, w, bp, out_dtype(tp), config=c)
        else:
            implementation = shared_expert_tma if isinstance(c, TmaConfig) else shared_expert_triton
            if kernel == "gate_up":
                fn = lambda x, w: implementation.gate_up_situ(x, w, 4.0, 25.0, config=c)  # noqa: E731
            else:
                fn = lambda h, w: implementation.down_proj(h, w, out_dtype(tp), config=c)  # noqa: E731
        x, w = operands(tp, bp, kernel)
        return jax.jit(fn).lower(x, w[0]).compile()

    def check(kernel, got, want):
        bf16 = got.dtype == jnp.bfloat16
        if got.shape != want.shape:  # hidden.T from a gate/up that hands it over so
            got = got[:, : want.shape[0]].T
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
        err = (np.abs(got - want) / scale).max()
        limit = 2.0**-6 if bf16 else 1e-5  # bf16 roundings may flip; float32 sums
        return None if err <= limit else f"mismatch {err:.2e} of the row's max"

    def measure(jobs, pool, budget_s=None):
        """Compile ``jobs`` in ``pool``, check and time each in order; rows for ``results``. With no
        ``budget_s`` every compile finishes before the first timing (XLA autotunes its dots on the
        GPU as it compiles them, which would land in a timing's CUPTI records); with one, the jobs
        still waiting when it runs out are skipped."""
        futures = [(job, pool.submit(compile_one, job)) for job in jobs]
        if budget_s is None:
            concurrent.futures.wait([f for _, f in futures])
        deadline = time.time() + (budget_s if budget_s is not None else float("inf"))
        rows = []
        for job, future in futures:
            tp, bp, kernel, c = job
            row = dict(tp=tp, batch=bp, kernel=kernel,
                       config=None if c is None else config_to_json(c))
            if time.time() > deadline:
                future.cancel()
                row["error"] = "skipped: time budget"
                rows.append(row)
                continue
            try:
                fn = future.result()
                x, w = operands(tp, bp, kernel)
                want = refs[tp, bp, "down" if kernel == "down_t" else kernel]
                bad = check(kernel, fn(x, w[0]), want)
                if bad:
                    row["error"] = bad
                else:
                    us, kernels = cupti_us_per_call(fn, x, w)
                    row.update(us=us, kernels=kernels)
            except Exception as e:  # a variant that fails is recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=1)
            row["done_s"] = round(time.time() - start, 1)  # where a budget goes (compiles, timings)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        return rows

    # XLA's references and the schedules each key runs now first, all of them, then the candidates
    # within --budget-s (on the H200 the references' compiles, which autotune, once took a 150 s
    # budget before any candidate: 2026-12-06, c40ee46).
    first = [job for job in jobs if job[3] is None or job[3] in running[job[:2]]]
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        results = measure(first, pool)
        results += measure([job for job in jobs if job not in first], pool, args.budget_s)

    best, xla = {}, {}
    for row in results:
        kernel = row["kernel"]
        config = row["config"] and config_from_json(row["config"], KERNEL_CONFIGS)
        if kernel == "gate_up" and hands_over_transposed(config):
            kernel = "gate_up_t"  # pairs with down_t
        key = (row["tp"], row["batch"], kernel)
        if row["config"] is None:
            xla[key] = row.get("us", nan)
        elif "us" in row and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row

    def pair(tp, bp):
        """The fastest (gate/up, down) rows of a key that run together, or None."""
        pairs = [(best.get((tp, bp, g)), best.get((tp, bp, d)))
                 for g, d in (("gate_up", "down"), ("gate_up_t", "down_t"))]
        pairs = [(g, d) for g, d in pairs if g and d]
        return min(pairs, key=lambda gd: gd[0]["us"] + gd[1]["us"]) if pairs else None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_shared_expert.json"), "w") as f:
        json.dump(dict(device=kind, results=results), f, indent=1)
    entries, earlier = {}, ""
    if args.merge and args.table and os.path.exists(args.table):
        merged = json.load(open(args.table))
        entries, earlier = merged["entries"], merged["command"] + "; then "
    for tp, s in shapes.items():
        for bp in batches:
            if found := pair(tp, bp):
                gu, dn = found
                entries[se.table_key(s.shared, s.hidden, bp)] = dict(
                    tp=tp, gate_up=gu["config"], down=dn["config"],
                    gate_up_us=round(gu["us"], 3), down_us=round(dn["us"], 3),
                    us=round(gu["us"] + dn["us"], 3),
                )
    name = "shared_expert.json"
    table = dict(device_kind=kind, generated=time.strftime("%Y-%m-%d"),
                 command=earlier + "python benchmarks/tune_shared_expert.py --table "
                         + (args.table or f"pallas/tuning/{kind_folder(kind)}/{name}")
                         + f" --tps {args.tps} --batches {args.batches} --budget-s {args.budget_s:g}"
                         + (" --merge" if args.merge else "")
                         + (f" --schedules {args.schedules}" if kinds != set(KINDS) else ""),
                 entries=entries)
    for path in filter(None, [args.table, os.path.join(args.out, name)]):
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
    print(f"\n{'tp':>3} {'B':>4} {'gate_up us':>10} {'TB/s':>6} {'down us':>8} {'TB/s':>6} "
          f"{'sum':>7} {'xla sum':>7}  gate_up config | down config   (xla: each kernel's XLA "
          f"reference, same run)")
    for tp, s in shapes.items():
        for bp in batches:
            if not (found := pair(tp, bp)):
                print(f"{tp:>3} {bp:>4} (no working schedule)")
                continue
            gu, dn = found
            print(f"{tp:>3} {bp:>4} {gu['us']:>10.2f} {tbs(s.gate_up_bytes, gu['us']):>6.2f} "
                  f"{dn['us']:>8.2f} {tbs(s.down_bytes, dn['us']):>6.2f} {gu['us'] + dn['us']:>7.2f}"
                  f" {xla.get((tp, bp, 'gate_up'), nan) + xla.get((tp, bp, 'down'), nan):>7.2f}"
                  f"  {config_label(gu['config'])} | {config_label(dn['config'])}")
    failed = sum("error" in r for r in results)
    print(f"{len(results)} variants, {failed} failed or skipped, {time.time() - start:.0f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
