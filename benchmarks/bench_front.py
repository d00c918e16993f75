"""The whole MoE front per layer of a decode step, as a user runs it, on each backend (GPU).

  python benchmarks/bench_front.py --out $OUT [--tps 1,2,4,8] [--batches ...] [--layers 6]

A jitted program runs ``--layers`` layers one after another, as a decode step chains them: each layer
has its own Kimi-K3 weights with the shared expert, and each layer's ``x`` is held behind the previous
layer's outputs (an optimization barrier), so no layer starts early. At tp1 a layer is
``moe_front(x, params, plan=True, backend=...)``. At tp 2, 4 and 8 it is one rank's work with the
exchange left out: the rank's front GEMM, its logits and latent repeated tp times where the
exchange's all-gather would deliver every rank's, routing over all experts, the plan, and the
shared expert's float32 partial sum (a rank's plan, ``mf.explain(..., axis_name=...)``, without
the collectives). Per layer,
for ``xla``, ``auto`` and ``pallas`` in one process: the span (the program's first kernel start to
its last kernel end in a profiler trace, divided by the layers: gaps and launches included), the
sum of its kernels' times (CUPTI's, from the same trace), the host's wall clock, and the kernels
launched; and the host's side for a program that returns one small scalar, as a serving loop's
step does: the dispatch time (until the call returns) and the pipelined time (calls back to back,
one block at the end). The floor is the layer's weight bytes at the read ceiling measured in the
same run (XLA's float32 sum over 2 GiB of bf16).
The table prints last; everything goes to $OUT/bench_front.json (a variant that fails to compile
or run is listed under "failed" with its error, and the run goes on), and the figures to
$OUT/bench_front.png (span against B) and $OUT/bench_front_breakdown.png (each layer's kernel time
by kind, stacked, beside the floor) where matplotlib is installed. ``--replot FILE`` prints the
tables and draws the figures again from a bench_front.json, on any machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_front_jax as mf
import timing
from moe_front_jax import registry
from moe_front_jax.pallas.engine import layer as layer_kernel

BACKENDS = ("xla", "auto", "pallas", "engine", "layer")
"""``engine``: one rank's layer at tp > 1 on the streaming engine's merged front
(``pallas.engine.front_gate_up``: router, latent, plan and the shared expert's gate/up in one
launch), the routing kernel and the engine's down (B <= 64). At tp1 ``pallas`` is that already
(``moe_front`` merges there), so ``engine`` runs only at tp > 1. ``layer``: the layer kernel
(``pallas.engine.layer``: front, plan and the whole shared expert in one launch), then the routing
kernel, at every tp (B <= 64)."""


def weight_bytes(cfg: mf.FrontConfig) -> int:
    """The bytes of weight one rank's layer reads: router, latent, gate/up and down rows."""
    rows = cfg.experts_per_rank + cfg.latent_per_rank + 2 * cfg.shared_per_rank
    return 2 * cfg.hidden * rows + 2 * cfg.hidden * cfg.shared_per_rank


def layer_params(cfg: mf.FrontConfig, layers: int) -> list[mf.FrontParams]:
    """Rank 0's params of ``layers`` layers, each drawn from its own seed."""
    out = []
    for layer in range(layers):
        weights = mf.init_weights(jax.random.key(layer), cfg.with_tp(1), shared=True)
        out.append(mf.pack_params(weights, cfg, rank=0))
        del weights
    return out


def gathered(tp: int, *shards):
    """Each rank's shard repeated ``tp`` times along its columns: what the exchange's all-gather
    would deliver (``rank_layer``)."""
    return tuple(jnp.tile(shard, (1, tp)) for shard in shards)


def rank_layer(x, params: mf.FrontParams, backend: str):
    """One rank's layer at ``params.cfg.tp > 1``, the exchange left out (module docstring)."""
    cfg = params.cfg
    logits, latent = registry.run("front_gemm", backend, x, params.packed, params.split,
                                  cfg.experts_per_rank)
    logits, latent = gathered(cfg.tp, logits, latent)
    ids, weights = registry.run("route", backend, logits, params.bias, cfg)
    plan = registry.run("plan", backend, latent, cfg.plan_block)
    shared = registry.run("shared_expert", backend, x, params.gate_up, params.down, cfg, jnp.float32)
    return ids, weights, latent, logits, shared, plan


def engine_layer(x, params: mf.FrontParams):
    """One rank's layer on the merged front (``front_gate_up``, ``route``, ``shared_down``), the
    exchange left out as in ``rank_layer``."""
    cfg = params.cfg
    backend = "pallas" if registry.on_gpu() else "interpret"
    logits, latent, plan, hidden = registry.run(
        "front_gate_up", backend, x, params.packed, params.split, cfg.experts_per_rank,
        params.gate_up, cfg, plan=True)
    logits, latent, *plan = gathered(cfg.tp, logits, latent, *plan)
    ids, weights = registry.run("route", backend, logits, params.bias, cfg)
    shared = registry.run("shared_down", backend, hidden, params.down, jnp.float32)
    return ids, weights, latent, logits, shared, plan


def kernel_layer(x, params: mf.FrontParams):
    """A layer on the layer kernel, then the routing kernel; at tp > 1 one rank's, the exchange
    left out as in ``rank_layer``."""
    cfg = params.cfg
    backend = "pallas" if registry.on_gpu() else "interpret"
    out_dtype = jnp.float32 if cfg.tp > 1 else jnp.bfloat16
    logits, latent, plan, shared = layer_kernel.layer(
        x, params.packed, params.split, cfg.experts_per_rank, params.gate_up, params.down, cfg,
        plan=True, out_dtype=out_dtype, interpret=backend == "interpret")
    logits, latent, *plan = gathered(cfg.tp, logits, latent, *plan)
    ids, weights = registry.run("route", backend, logits, params.bias, cfg)
    return ids, weights, latent, logits, shared, plan


def layer(backend: str, tp: int):
    if backend == "engine":
        return engine_layer
    if backend == "layer":
        return kernel_layer
    if tp == 1:
        return lambda x, params: mf.moe_front(x, params, plan=True, backend=backend)
    return lambda x, params: rank_layer(x, params, backend)


def read_ceiling_tbs() -> float:
    """XLA's float32 sum over 2 GiB of bf16, CUPTI: the HBM read ceiling of this run."""
    data = jnp.ones((1 << 30,), jnp.bfloat16)
    total = jax.jit(lambda a, _: jnp.sum(a, dtype=jnp.float32))
    us, _ = timing.cupti_us_per_call(total, data, [None] * 4)
    return data.nbytes / (us * 1e-6) / 1e12


def measure(backend: str, tp: int, batch: int, params, calls: int) -> dict:
    """One backend's layer: compile and run a program of ``len(params)`` layers, time the host's
    wall clock over ``calls`` programs, then trace ``calls`` more (``timing.trace_programs``): per
    layer, the median program's span and its kernels' summed time, both divided by the layers,
    and each kernel name's summed time a layer (``kernel_us``).
    Programs whose kernel count is not the most common one (a trace that lost some) are left out
    and counted."""
    cfg = params[0].cfg
    layers = len(params)
    xs = [timing.rows(batch, cfg.hidden, seed=i) for i in range(layers)]
    start = time.perf_counter()
    program = timing.chain_program(layer(backend, tp), xs, params)  # compiled and run once
    compile_s = time.perf_counter() - start
    walls = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(program())
        walls.append(time.perf_counter() - start)
    dispatch_us, pipelined_us = host_us(
        timing.chain_program(layer(backend, tp), xs, params, small=True), 3 * calls)
    traced = timing.trace_programs(program, calls)
    if not traced:
        raise RuntimeError("the profiler trace holds no kernel on the GPU's streams")
    count = collections.Counter(len(p) for p in traced).most_common(1)[0][0]
    kept = [p for p in traced if len(p) == count]
    names = dict.fromkeys(name for name, _, _ in kept[0])
    kernel_us = {name: statistics.median(sum(d for n, _, d in p if n == name) for p in kept) / layers
                 for name in names}
    return dict(
        backend=backend, tp=tp, batch=batch, layers=layers, compile_s=round(compile_s, 1),
        kernels_per_layer=count / layers,
        cupti_us=statistics.median(sum(d for _, _, d in p) for p in kept) / layers,
        span_us=statistics.median(max(s + d for _, s, d in p) for p in kept) / layers,
        programs_traced=len(kept), programs_left_out=len(traced) - len(kept),
        wall_us=statistics.median(walls) * 1e6 / layers,
        dispatch_us=dispatch_us / layers, pipelined_us=pipelined_us / layers,
        kernels=[name for name, _, _ in kept[0][: count // layers]],
        program_kernels=[name for name, _, _ in kept[0]],
        kernel_us={name: round(us, 2) for name, us in kernel_us.items()},
    )


def host_us(program, calls: int) -> tuple[float, float]:
    """The host's side of ``program`` (``chain_program(..., small=True)``), microseconds a program:
    the dispatch time (the median call's return, the GPU idle when it starts) and the pipelined
    time (``calls`` calls back to back, one block at the end, divided by ``calls``)."""
    dispatch = []
    for _ in range(calls):
        start = time.perf_counter()
        out = program()
        dispatch.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    start = time.perf_counter()
    jax.block_until_ready([program() for _ in range(calls)])
    return statistics.median(dispatch) * 1e6, (time.perf_counter() - start) / calls * 1e6


def check(tp: int, batch: int) -> None:
    """On any machine: one small layer of each backend (``pallas`` in interpret mode off a GPU)
    gives the reference's ids, weights and plan."""
    cfg = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=256, shared=256).with_tp(tp)
    params = layer_params(cfg, 2)
    xs = [timing.rows(batch, cfg.hidden, seed=i) for i in range(2)]
    want = timing.chain_program(layer("xla", tp), xs, params)()
    kernels = "pallas" if registry.on_gpu() else "interpret"
    for backend in ("auto", kernels, "layer", *(("engine",) if tp > 1 else ())):
        got = timing.chain_program(layer(backend, tp), xs, params)()
        for one, ref in zip(got, want):
            for field in (0, 1):  # ids, weights
                np.testing.assert_array_equal(np.asarray(one[field]), np.asarray(ref[field]))
    print(f"check tp={tp} B={batch}: auto and the kernels match xla")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (said) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no figure")
        return None
    return plt


def draw(rows: list[dict], path: str, device: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    tps = sorted({r["tp"] for r in rows})
    fig, axes = plt.subplots(1, len(tps), figsize=(4.5 * len(tps), 3.8), squeeze=False)
    for ax, tp in zip(axes[0], tps):
        for backend in BACKENDS:
            pts = sorted((r["batch"], r["span_us"]) for r in rows
                         if r["tp"] == tp and r["backend"] == backend and r["span_us"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=backend)
        floors = sorted({(r["batch"], r["floor_us"]) for r in rows if r["tp"] == tp})
        ax.plot(*zip(*floors), "k--", label="floor")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"tp={tp}" + (" (one rank, no exchange)" if tp > 1 else ""))
        ax.set_xlabel("batch B")
        ax.set_ylabel("span per layer (us)")
        ax.legend()
    fig.suptitle(f"moe_front per layer, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def kinds(row: dict) -> dict[str, float]:
    """A row's kernel time a layer by kernel kind (``timing.kernel_kind``: XLA numbers a fusion
    per layer, ``sort_1`` ... ``sort_5``, so a name alone is one layer's kernel amortized over the
    program), the largest first."""
    out = collections.Counter()
    for name, us in row["kernel_us"].items():
        out[timing.kernel_kind(name)] += us
    return dict(out.most_common())


def draw_breakdown(rows: list[dict], path: str, device: str, most: int = 16) -> None:
    """``path``: one panel per tp, a horizontal bar per (B, backend) stacking its kernel time a
    layer by kind (the ``most`` largest kinds over the panel coloured, the rest "other") and the
    span's gaps past it, beside the floor (dashed)."""
    plt = pyplot()
    if plt is None:
        return
    tps = sorted({r["tp"] for r in rows})
    height = max(2.5, 0.32 * max(sum(r["tp"] == tp for r in rows) for tp in tps) + 1.5)
    fig, axes = plt.subplots(len(tps), 1, figsize=(10, height * len(tps)), squeeze=False)
    for ax, tp in zip(axes[:, 0], tps):
        mine = sorted((r for r in rows if r["tp"] == tp), key=lambda r: (-r["batch"], r["backend"]))
        totals = collections.Counter()
        for r in mine:
            totals.update(kinds(r))
        shown = [k for k, _ in totals.most_common(most)]
        colours = dict(zip(shown + ["other", "gaps"], plt.cm.tab20.colors))
        for y, r in enumerate(mine):
            spent, left = kinds(r), 0.0
            parts = [(k, spent.get(k, 0.0)) for k in shown]
            parts += [("other", sum(v for k, v in spent.items() if k not in shown)),
                      ("gaps", max(0.0, (r["span_us"] or 0.0) - r["cupti_us"]))]
            for k, us in parts:
                ax.barh(y, us, left=left, color=colours[k], label=k if y == 0 else None)
                left += us
        ax.axvline(mine[0]["floor_us"], color="k", ls="--", label="floor")
        ax.set_xlim(0, 1.02 * max(max(r["span_us"] or 0.0, r["cupti_us"]) for r in mine))
        ax.set_yticks(range(len(mine)), [f"B={r['batch']} {r['backend']}" for r in mine])
        ax.set_xlabel("us a layer (kernel time by kind, then gaps to the span)")
        ax.set_title(f"tp={tp}" + (" (one rank, no exchange)" if tp > 1 else ""))
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"where a layer's time goes, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(rows: list[dict], backends: list[str]) -> None:
    """The tables: span / CUPTI / wall per backend, the host's side, and the time by kernel kind."""
    print("\n| tp | B | floor | " + " | ".join(f"{b} span / CUPTI / wall (kernels)" for b in
                                              backends) + " | xla / auto span |")
    print("| --- " * (4 + len(backends)) + "|")
    for tp, batch in dict.fromkeys((r["tp"], r["batch"]) for r in rows):
        mine = {r["backend"]: r for r in rows if (r["tp"], r["batch"]) == (tp, batch)}
        cells = [f"{r['span_us'] or float('nan'):.1f} / {r['cupti_us']:.1f} / {r['wall_us']:.0f} "
                 f"({r['kernels_per_layer']:.3g})" if (r := mine.get(b)) else "-" for b in backends]
        ratio = (mine["xla"]["span_us"] / mine["auto"]["span_us"]
                 if {"xla", "auto"} <= set(mine) and mine["auto"]["span_us"] else float("nan"))
        floor = next(iter(mine.values()))["floor_us"]
        print(f"| {tp} | {batch} | {floor:.1f} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    print("\nthe host a layer, one small output (us): dispatch / pipelined, beside the span:")
    for r in rows:
        print(f"  tp{r['tp']} B={r['batch']} {r['backend']}: {r['dispatch_us']:.1f} / "
              f"{r['pipelined_us']:.1f} (span {r['span_us'] or float('nan'):.1f})")
    print("\nwhere a layer's time goes (us a layer by kernel kind; the span adds gaps):")
    for r in rows:
        print(f"  tp{r['tp']} B={r['batch']} {r['backend']}: " + ", ".join(
            f"{kind} {us:.1f}" for kind, us in kinds(r).items()))


def replot(path: str, out: str) -> None:
    """``--replot``: the tables and figures of a bench_front.json, into ``out``."""
    with open(path) as f:
        result = json.load(f)
    rows, device = result["rows"], result["device"]
    os.makedirs(out, exist_ok=True)
    draw(rows, os.path.join(out, "bench_front.png"), device)
    draw_breakdown(rows, os.path.join(out, "bench_front_breakdown.png"), device)
    report(rows, list(dict.fromkeys(r["backend"] for r in rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tps", default="1,2,4,8")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256",
                        help="tp1's batches; tp > 1 runs --rank-batches")
    parser.add_argument("--rank-batches", default="1,8,64")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--layers", type=int, default=timing.CHAIN, help="layers per program")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--check", action="store_true",
                        help="only check, small shapes, on any machine (interpret mode off a GPU)")
    parser.add_argument("--replot", metavar="FILE",
                        help="a bench_front.json: print its tables, draw its figures into --out")
    args = parser.parse_args()
    if args.replot:
        replot(args.replot, args.out)
        return
    tps = [int(t) for t in args.tps.split(",")]
    if args.check:
        for tp in tps:
            check(tp, 3)
        return
    ceiling = read_ceiling_tbs()
    print(f"{jax.devices()[0].device_kind}: read ceiling {ceiling:.2f} TB/s", flush=True)
    rows, failed = [], []
    for tp in tps:
        cfg = mf.KIMI_K3.with_tp(tp)
        params = layer_params(cfg, args.layers)
        floor = weight_bytes(cfg) / (ceiling * 1e12) * 1e6
        batches = args.batches if tp == 1 else args.rank_batches
        for batch in (int(b) for b in batches.split(",")):
            for backend in args.backends.split(","):
                if backend in ("engine", "layer") and batch > 64 or backend == "engine" and tp == 1:
                    continue  # the engine covers B <= 64; at tp1 "engine" is "pallas"
                try:
                    row = measure(backend, tp, batch, params, args.calls)
                except Exception as error:  # one variant's failure is a row, not the end of the run
                    print(f"tp={tp} B={batch} {backend}: FAILED {type(error).__name__}: "
                          f"{str(error)[:400]}", flush=True)
                    failed.append(dict(backend=backend, tp=tp, batch=batch,
                                       error=f"{type(error).__name__}: {error}"))
                    continue
                row.update(floor_us=floor, weight_bytes=weight_bytes(cfg))
                rows.append(row)
                print(f"tp={tp} B={batch} {backend}: span {row['span_us'] or float('nan'):.1f} us, "
                      f"CUPTI {row['cupti_us']:.1f}, wall {row['wall_us']:.1f}, dispatch "
                      f"{row['dispatch_us']:.1f}, pipelined {row['pipelined_us']:.1f}, "
                      f"{row['kernels_per_layer']:g} kernels, compile {row['compile_s']} s", flush=True)
        del params
    os.makedirs(args.out, exist_ok=True)
    result = dict(device=jax.devices()[0].device_kind, read_ceiling_tbs=ceiling,
                  layers=args.layers, rows=rows, failed=failed)
    with open(os.path.join(args.out, "bench_front.json"), "w") as f:
        json.dump(result, f, indent=1)
    device = result["device"]
    draw(rows, os.path.join(args.out, "bench_front.png"), device)
    draw_breakdown(rows, os.path.join(args.out, "bench_front_breakdown.png"), device)
    report(rows, args.backends.split(","))


if __name__ == "__main__":
    main()
