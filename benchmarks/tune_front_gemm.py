"""Regenerate the front GEMM's tuning table on the GPU: pallas/tuning/<device kind>/front_gemm.json.

For every tp shape of K3 and every batch rounded up to a power of two (1 ... 256) it compiles the
schedule the key runs now (``--table``'s entry, else the package's pick on this device; not under
``--refine``) and a pruned set of schedules (rows per program, K step, split-K, warps, pipeline
depth, stream-K programs; up to B = 8 the vector schedules too), checks each against a float64
product of the same data (the GPU tests' bounds, ``timing.LOGITS_RTOL``, which XLA's product meets
too), times the correct ones with CUPTI over weights rotated past the L2, and keeps the fastest.

  python benchmarks/tune_front_gemm.py --out $OUT [--table pallas/tuning/nvidia-h200/front_gemm.json]
  python benchmarks/tune_front_gemm.py --batches 1,2,4,8 --merge --table ...   (add keys to a table)

Prints one line per (tp, batch) last; the full results go to $OUT/tune_front_gemm.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax import reference
from moe_front_jax.pallas import front_gemm as fg
from moe_front_jax.pallas.device import kind_folder
from moe_front_jax.pallas.gemm.schedule import (
    TRITON_CONFIGS,
    VECTOR_MAX_BATCH,
    GridConfig,
    StreamKConfig,
    VectorConfig,
    config_from_json,
    config_to_json,
)
from timing import (
    TUNE_SMEM_BUDGET, FrontShape, config_label, contract_errors, cupti_us_per_call, divisors,
    float64_product, packed_weights, rows, tbs, vector_schedules, xla_dot,
)


def candidates(shape: FrontShape, bp: int, cores: int = 132) -> list[fg.FrontGemmConfig]:
    """The schedules worth timing for one shape and padded batch.

    Rows per program 32, 64, 128 (and 16 for batch tiles up to 32); for each, the
    smallest split-K that gives every SM a program and the smallest that gives two; a K step of 128
    or 256 (64 too for the small shards, for finer splits; 64 or 128 at large batches, whose x tile
    is wide), and 512 or 1024 up to a batch tile of 64 (1-2 KB of each weight row per step, fewer
    DRAM pages open at once); the deepest pipeline that fits the shared memory; 4 warps for small
    tiles, 8 for large. Up to a batch tile of 64, with 128 or 256 K steps, stream-K too
    (``StreamKConfig.programs``) over one, two and three programs per SM.
    """
    out = []
    few_rows = shape.valid + shape.shard < 2 * cores * 16  # tp >= 2: split K finely
    for bn in ((16, 32, 64, 128) if bp <= 32 else (32, 64, 128)):
        tiles = -(-shape.valid // bn) + -(-shape.shard // bn)
        long_k = (512, 1024) if bn <= 32 else (512,)  # 1-2 KB of each row per step
        for bk in ((64, 128, 256) if few_rows else (128, 256)) + long_k if bp <= 64 else (64, 128):
            steps = shape.hidden // bk
            splits = [s for s in divisors(steps) if s <= 28 and steps // s >= 2]
            chosen = []
            for target in (cores, 2 * cores):
                fit = [s for s in splits if tiles * s >= target]
                if fit and fit[0] not in chosen:
                    chosen.append(fit[0])
            if not chosen:
                chosen = [splits[-1]]
            warps = 4 if bn * bp <= 64 * 64 else 8
            per_stage = 2 * bk * (bn + bp)
            deepest = min(6, TUNE_SMEM_BUDGET // per_stage)
            for s in chosen:
                depth = min(deepest, shape.hidden // (s * bk))
                if depth >= 2:
                    out.append(GridConfig(bn, bk, s, warps, depth))
            if bp <= 64 and bn <= 64 and bk in (128, 256):
                # Stream-K: every program an equal run of the tiles' K steps (no tail of
                # programs on some SMs only), one to three per SM.
                for programs in (cores, 2 * cores, 3 * cores):
                    out.append(StreamKConfig(bn, bk, warps, max(2, deepest), programs))
    return out


def vector_candidates(shape: FrontShape, batch: int, cores: int = 132) -> list[fg.FrontGemmConfig]:
    """The vector schedules worth timing for a batch of at most ``VECTOR_MAX_BATCH``
    (``timing.vector_schedules``)."""
    def tiles(bn):
        return -(-shape.valid // bn) + -(-shape.shard // bn)

    return [VectorConfig(bn, bk, warps)
            for bn, bk, warps in vector_schedules(tiles, shape.hidden, 1, batch, cores)]


def check(got_logits, got_latent, y: np.ndarray, split: int) -> str | None:
    """None when the kernel's outputs are within the contract against the float64 product ``y``
    (``timing.contract_errors``), else by how much they are not."""
    err_l, err_t = contract_errors(got_logits, got_latent, y, split)
    if err_l > 1 or err_t > 1:
        return f"outside the contract: logits {err_l:.2f}x their bound, latent {err_t:.2f} ulp"
    return None


def ranked(results: list[dict], tp: int, bp: int) -> list[fg.FrontGemmConfig]:
    """The schedules measured for (tp, bp), fastest first."""
    rows = sorted((r for r in results if r["tp"] == tp and r["batch"] == bp and "us" in r
                   and not r.get("plan")), key=lambda r: r["us"])
    return [config_from_json(r["config"], TRITON_CONFIGS) for r in rows]


def neighbours(ranked_configs: list[fg.FrontGemmConfig], bp: int) -> list[fg.FrontGemmConfig]:
    """The two fastest schedules of an earlier run, and the fastest with the other warp count and
    with a two-stage deeper pipeline (where shared memory allows; the vector schedule has none)."""
    out = ranked_configs[:2]
    if out:
        best = out[0]
        out.append(dataclasses.replace(best, num_warps=12 - best.num_warps))
        deeper = getattr(best, "num_stages", 0) + 2
        stage = 2 * best.block_k * (best.block_rows + bp)
        if not isinstance(best, VectorConfig) and stage * deeper <= TUNE_SMEM_BUDGET:
            out.append(dataclasses.replace(best, num_stages=deeper))
    return list(dict.fromkeys(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--table", default=None, help="write the table here")
    parser.add_argument("--merge", action="store_true",
                        help="keep the --table file's entries for the keys this run does not tune")
    parser.add_argument("--tps", default="1,2,4,8")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--refine", default=None,
                        help="an earlier run's tune_front_gemm.json: time its best schedules per key "
                             "and their neighbours (and the plan over its four best) instead "
                             "of the sweep")
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    start = time.time()
    device = jax.devices()[0]
    kind = device.device_kind
    print("device", kind, "cores", getattr(device, "core_count", None), flush=True)

    shapes = {tp: FrontShape(tp) for tp in map(int, args.tps.split(","))}
    batches = list(map(int, args.batches.split(",")))
    previous = json.load(open(args.refine))["results"] if args.refine else None
    current = json.load(open(args.table))["entries"] if args.table and os.path.exists(args.table) else {}

    def now(shape, bp):
        """The schedule a key runs now: its --table entry, else the package's pick on this device
        (its table, the one it borrows, or the heuristic's), timed first so that a sweep cut short
        by its budget still has it to beat."""
        entry = current.get(fg.table_key(shape.valid, shape.shard, shape.hidden, bp))
        if entry:
            return config_from_json(entry["config"], TRITON_CONFIGS)
        return fg.pick_config(shape.valid, shape.shard, shape.hidden, bp)

    per_key = [
        [(tp, bp, cfg) for cfg in dict.fromkeys(
            neighbours(ranked(previous, tp, bp), bp) if previous
            else [now(shape, bp)] + candidates(shape, max(bp, 16))
            + (vector_candidates(shape, bp) if bp <= VECTOR_MAX_BATCH else []))]
        for tp, shape in shapes.items()
        for bp in batches
    ]
    # Round robin over (tp, batch), so that a run cut short by its budget covers every key.
    jobs = [lst[i] for i in range(max(map(len, per_key))) for lst in per_key if i < len(lst)]
    print(f"{len(jobs)} variants", flush=True)

    weights = {tp: packed_weights(shape) for tp, shape in shapes.items()}
    xs = {bp: rows(bp, 7168, seed=1) for bp in batches}
    xla = {}
    for tp, shape in shapes.items():
        for bp, x in xs.items():
            f = jax.jit(xla_dot)
            us, _ = cupti_us_per_call(f, x, weights[tp])
            y = float64_product(x, weights[tp][0])
            out = f(x, weights[tp][0])
            err = contract_errors(out[:, :shape.valid], out[:, shape.split:].astype(jnp.bfloat16), y,
                                  shape.split)
            xla[(tp, bp)] = dict(us=us, y=y, errors=err)
            print(f"xla tp{tp} B{bp}: {us:.2f} us; its error: logits {err[0]:.2f}x the bound, "
                  f"latent {err[1]:.2f} ulp", flush=True)

    def compile_one(job, plan=False):
        tp, bp, cfg = job
        shape = shapes[tp]
        gemm = fg.front_gemm_plan if plan else fg.front_gemm
        fn = jax.jit(lambda x, w: gemm(x, w, shape.split, shape.valid, config=cfg))
        return fn.lower(xs[bp], weights[tp][0]).compile()

    def measure(jobs, plan):
        results = []
        deadline = time.time() + args.budget_s
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            futures = [(job, pool.submit(compile_one, job, plan)) for job in jobs]
            for job, future in futures:
                tp, bp, cfg = job
                row = dict(tp=tp, batch=bp, plan=plan, config=config_to_json(cfg))
                if time.time() > deadline:
                    future.cancel()
                    row["error"] = "skipped: time budget"
                    results.append(row)
                    continue
                try:
                    fn = future.result()
                    out = fn(xs[bp], weights[tp][0])
                    bad = check(out[0], out[1], xla[(tp, bp)]["y"], shapes[tp].split)
                    if plan and not bad:
                        want = jax.jit(reference.mxfp8_plan)(out[1])
                        if not all((np.asarray(a).view(np.uint8) == np.asarray(b).view(np.uint8)).all()
                                   for a, b in zip(out[2], want)):
                            bad = "plan differs from reference.mxfp8_plan of the latent"
                    if bad:
                        row["error"] = bad
                    else:
                        us, kernels = cupti_us_per_call(fn, xs[bp], weights[tp])
                        row.update(us=us, kernels=kernels, tbs=tbs(shapes[tp].weight_bytes, us))
                except Exception as e:  # a variant that fails is recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc(limit=1)
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        return results

    def fastest(results):
        best = {}
        for row in results:
            key = (row["tp"], row["batch"])
            if "us" in row and (key not in best or row["us"] < best[key]["us"]):
                best[key] = row
        return best

    results = measure(jobs, plan=False)
    best = fastest(results)
    # The plan epilogue changes the kernel's registers and tail: its schedule is tuned apart, over
    # the four fastest plain schedules of each key.
    plan_jobs = []
    for tp, bp in best:
        configs = [c for c in ranked(previous or results, tp, bp)
                   if not isinstance(c, VectorConfig)][:4]
        configs = [dataclasses.replace(c, block_rows=max(c.block_rows, 32)) for c in configs]
        plan_jobs += [(tp, bp, c) for c in dict.fromkeys(configs)]
    plan_results = measure(plan_jobs, plan=True)
    plan_best = fastest(plan_results)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_front_gemm.json"), "w") as f:
        json.dump(dict(device=kind, results=results + plan_results,
                       xla={f"tp{t},B{b}": dict(us=v["us"], logits_error=v["errors"][0],
                                                 latent_ulp=v["errors"][1])
                            for (t, b), v in xla.items()}), f, indent=1)
    entries, earlier = {}, ""
    if args.merge and args.table and os.path.exists(args.table):
        merged = json.load(open(args.table))
        entries, earlier = merged["entries"], merged["command"] + "; then "
    for (tp, bp), row in sorted(best.items()):
        shape = shapes[tp]
        key = fg.table_key(shape.valid, shape.shard, shape.hidden, bp)
        entries[key] = dict(tp=tp, config=row["config"], us=round(row["us"], 3),
                            xla_us=round(xla[(tp, bp)]["us"], 3))
        if (tp, bp) in plan_best:
            entries[key].update(plan_config=plan_best[(tp, bp)]["config"],
                                plan_us=round(plan_best[(tp, bp)]["us"], 3))
    name = "front_gemm.json"
    table = dict(
        device_kind=kind,
        generated=time.strftime("%Y-%m-%d"),
        command=earlier
                + "python benchmarks/tune_front_gemm.py --table "
                + (args.table or f"pallas/tuning/{kind_folder(kind)}/{name}")
                + (" --refine <an earlier run's tune_front_gemm.json>" if previous else "")
                + f" --tps {args.tps} --batches {args.batches} --budget-s {args.budget_s:g}"
                + (" --merge" if args.merge else ""),
        entries=entries,
    )
    for path in filter(None, [args.table, os.path.join(args.out, name)]):
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
    print(f"\n{'tp':>3} {'B':>4} {'kernel us':>10} {'TB/s':>6} {'xla us':>8} {'xla/k':>6} "
          f"{'plan us':>8}  config | plan config")
    for (tp, bp), row in sorted(best.items()):
        x_us = xla[(tp, bp)]["us"]
        c = row["config"]
        p = plan_best.get((tp, bp))
        pc = p["config"] if p else {}
        print(f"{tp:>3} {bp:>4} {row['us']:>10.2f} {row['tbs']:>6.2f} {x_us:>8.2f} "
              f"{x_us / row['us']:>6.2f} {p['us'] if p else float('nan'):>8.2f}  "
              f"{config_label(c)} | {config_label(pc)}")

    for (tp, bp) in sorted(best):
        timed = [r for r in results if r["tp"] == tp and r["batch"] == bp and "us" in r]
        fastest_of = {}
        for r in sorted(timed, key=lambda r: r["us"]):
            fastest_of.setdefault(r["config"]["implementation"], r)
        print(f"  tp{tp} B{bp}: " + ", ".join(
            f"{name} {r['us']:.2f} us" for name, r in sorted(fastest_of.items())))
    failed = sum("error" in r for r in results + plan_results)
    outside = sum("outside the contract" in r.get("error", "") for r in results + plan_results)
    print(f"{len(results) + len(plan_results)} variants, {failed} failed or skipped "
          f"({outside} outside the contract), "
          f"{time.time() - start:.0f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
