"""The Lamport mailbox path of ``moe_front`` against the direct path, on the GPU.

Target: the mailbox adds at most 2 us per call at B <= 64 on the H200. For each B in {1, 8, 64, 256},
CUPTI kernel time per call, in one process: ``direct`` (``moe_front`` on ``"auto"``) and ``mailbox``
(the same with a donated box threaded from call to call); ``separate`` and ``fused``, the mailbox
path by hand (XLA's GEMM and the publish kernel, then the collect and routing kernels, or the routing
kernel polling the mailbox itself, ``pallas/route_collect``); ``exchange``, the mailbox alone
(publish + collect); ``direct_plan`` and ``mailbox_plan`` with ``plan=True``; ``direct_pallas``,
``mailbox_pallas``, ``separate_pallas`` and ``fused_pallas`` on ``backend="pallas"``, where the front
GEMM kernel publishes from its epilogue (``front_gemm_publish``, no publish kernel). Three weight
copies (3 x 64 MB, over the L2) and three inputs rotate; no input is zero. Also measured: how long a
collect and a ``route_collect`` on a never-published mailbox take to return their timeout status.
``--variants`` first sweeps the kernels' block sizes; ``--chunks 256,512`` ``route_collect``'s latent
chunk (``route_collect.kernel.LATENT_CHUNK``).

``--transports`` times instead the exchange alone per transport, for tp = 1 and every power of two up
to the GPU count, at B in {1, 8, 64}, Kimi-K3 shards on a ``"tp"`` mesh: ``allgather``
(``parallel.exchange``, XLA's all-gather), ``peer`` (the Mosaic GPU peer-store publish and the
collect) and, at tp = 1, ``gather`` (the jax-triton publish and collect); CUPTI time per call over tp.

  python3 benchmarks/bench_mailbox.py --out $OUT [--variants | --transports]   # after gpu_env.sh
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_front_jax as mf
from moe_front_jax import mailbox as mb
from moe_front_jax.pallas import front_gemm as fg
from moe_front_jax.pallas import route as rt
from moe_front_jax.pallas import route_collect as rc
from moe_front_jax.pallas.route_collect import kernel as route_collect_kernel

BATCHES = (1, 8, 64, 256)
COPIES = 3
ITERATIONS = 60


def kernel_times(
    launch, iterations: int, allow_none: bool = False
) -> list[list[tuple[str, float]]]:
    """CUPTI ``(kernel name, ms)`` of each of ``iterations`` calls ``launch(0), launch(1), ...``.

    ``allow_none``: a call that launches no kernel at all (XLA folded it away) gives empty lists.

    ``profiler.measure`` repeats one set of arguments, which a donated mailbox does not survive (the
    first call deletes its buffer): this is measure's loop, with ``launch`` threading the state.
    """
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    jax.block_until_ready(launch(0))  # compile and warm up
    ext._cupti_init()
    try:
        results = [launch(i) for i in range(iterations)]
        jax.block_until_ready(results)
    finally:
        timings = ext._cupti_get_timings(True)
    per_call, rest = divmod(len(timings), iterations)
    if allow_none and not timings:
        return [[] for _ in range(iterations)]
    if rest or not per_call:
        raise RuntimeError(f"{len(timings)} kernels over {iterations} calls")
    return [timings[i * per_call:(i + 1) * per_call] for i in range(iterations)]


def summarize(calls: list[list[tuple[str, float]]]) -> dict:
    """Median summed time per call (us), and per kernel name its median time per call (us), names in
    order of first launch (a name missing from a call counts 0 there)."""
    totals = [sum(ms for _, ms in call) * 1e3 for call in calls]
    names = list(dict.fromkeys(name for call in calls for name, _ in call))
    kernels = [
        (name, statistics.median(sum(ms for n, ms in call if n == name) for call in calls) * 1e3)
        for name in names
    ]
    return dict(us=statistics.median(totals), kernels=kernels)


def kernel_us(summary: dict, fragment: str) -> float:
    return sum(us for name, us in summary["kernels"] if fragment in name)


def bench_batch(batch: int, params: list, cfg) -> dict:
    from moe_front_jax.bridge import triton_mailbox as tm  # needs a GPU jaxlib

    xs = [
        (jax.random.normal(jax.random.key(100 + i), (batch, cfg.hidden)) + 0.1).astype(jnp.bfloat16)
        for i in range(COPIES)
    ]
    state = dict(box=mf.Mailbox.create(cfg, capacity=max(BATCHES)), statuses=[])

    direct = jax.jit(mf.moe_front, static_argnames=("plan", "backend"))
    step = jax.jit(mf.moe_front, static_argnames=("plan", "backend"), donate_argnames="mailbox")

    def run_direct(i, plan=False, backend="auto"):
        return direct(xs[i % COPIES], params[i % COPIES], plan=plan, backend=backend)

    def run_mailbox(i, plan=False, backend="auto"):
        out, state["box"] = step(xs[i % COPIES], params[i % COPIES], plan=plan, backend=backend,
                                 mailbox=state["box"])
        state["statuses"].append(out.status)
        return out

    def composed(gemm_publishes: bool, fused: bool):
        """One step of the mailbox path composed by hand: the publish by the front GEMM kernel's
        epilogue or by XLA's GEMM and the publish kernel; then ``route_collect`` or the collect and
        routing kernels."""

        @functools.partial(jax.jit, donate_argnums=2)
        def step(x, p, box):
            buffer, control, tickets = box.buffer, box.control, box.tickets
            if gemm_publishes:
                buffer, control, tickets, status = fg.front_gemm_publish(
                    x, p.packed, p.split, cfg.experts_per_rank, buffer, control, tickets, cfg)
            else:
                logits, latent = mf.reference.front_gemm(x, p.packed, p.split, cfg.experts_per_rank)
                buffer, control, status = tm.publish(buffer, control, logits, latent, 0, cfg)
            if fused:
                *out, status, buffer, control = rc.route_collect(buffer, control, status, p.bias,
                                                                 batch, cfg)
            else:
                logits, latent, status, buffer, control = tm.collect(buffer, control, status,
                                                                     batch, cfg)
                out = (*rt.route(logits, p.bias, cfg), logits, latent)
            return out, status, mf.Mailbox(buffer, control, tickets, cfg)

        def run(i):
            out, status, state["box"] = step(xs[i % COPIES], params[i % COPIES], state["box"])
            state["statuses"].append(status)
            return out

        return run

    runs = {
        "direct": run_direct,
        "mailbox": run_mailbox,
        "separate": composed(False, False),
        "fused": composed(False, True),
        "direct_plan": functools.partial(run_direct, plan=True),
        "mailbox_plan": functools.partial(run_mailbox, plan=True),
        "direct_pallas": functools.partial(run_direct, backend="pallas"),
        "mailbox_pallas": functools.partial(run_mailbox, backend="pallas"),
        "separate_pallas": composed(True, False),
        "fused_pallas": composed(True, True),
    }
    rounds = {name: [] for name in runs}
    for _ in range(2):  # interleaved, so that drift of the shared machine hits every path alike
        for name, run in runs.items():
            rounds[name] += kernel_times(run, ITERATIONS)
    shards = [
        mf.reference.front_gemm(x, p.packed, p.split, cfg.experts_per_rank) for x, p in zip(xs, params)
    ]

    def run_exchange(i):
        logits, latent, status, state["box"] = mb.exchange(state["box"], *shards[i % COPIES])
        state["statuses"].append(status)
        return logits, latent

    exchange = summarize(kernel_times(run_exchange, ITERATIONS))
    statuses = {int(s) for s in state["statuses"]}
    if statuses != {0}:
        raise RuntimeError(f"B={batch}: mailbox statuses {statuses}, expected only 0")
    row = dict(batch=batch, **{name: summarize(rounds[name]) for name in runs})
    row["exchange"] = exchange
    for path, base in (("mailbox", "direct"), ("separate", "direct"), ("fused", "direct"),
                       ("mailbox_pallas", "direct_pallas"), ("separate_pallas", "direct_pallas"),
                       ("fused_pallas", "direct_pallas"), ("mailbox_plan", "direct_plan")):
        row[f"{path}_added_us"] = row[path]["us"] - row[base]["us"]
    row.update(
        plan_added_direct_us=row["direct_plan"]["us"] - row["direct"]["us"],
        plan_added_mailbox_us=row["mailbox_plan"]["us"] - row["mailbox"]["us"],
        gemm_pallas_us=kernel_us(row["direct_pallas"], "front_gemm"),
        gemm_publish_us=kernel_us(row["separate_pallas"], "front_gemm_publish"),
        publish_us=kernel_us(row["separate"], "mailbox_publish"),
        collect_us=kernel_us(row["separate"], "mailbox_collect"),
        route_us=kernel_us(row["direct"], "route"),
        route_collect_us=kernel_us(row["fused"], "route_collect"),
        route_collect_pallas_us=kernel_us(row["fused_pallas"], "route_collect"),
    )
    return row


def timeout_seconds(cfg, batch: int, fused: bool) -> float:
    """Wall time of a collect (``fused``: a ``route_collect``) on a never-published mailbox, after a
    first, compiling call."""
    bias = jnp.zeros((cfg.experts,), jnp.float32)
    if fused:
        def route_collect(box):
            *_, status, buffer, control = rc.route_collect(
                box.buffer, box.control, jnp.zeros((), jnp.int32), bias, batch, cfg)
            return status, mf.Mailbox(buffer, control, box.tickets, cfg)

        collect = jax.jit(route_collect, donate_argnums=0)
    else:
        collect = jax.jit(lambda box: mb.collect(box, batch)[-2:], donate_argnums=0)
    box = mf.Mailbox.create(cfg, capacity=max(BATCHES))
    status, box = jax.block_until_ready(collect(box))
    start = time.perf_counter()
    status, box = jax.block_until_ready(collect(box))
    elapsed = time.perf_counter() - start
    if int(status) != mf.Mailbox.TIMEOUT:
        raise RuntimeError(f"a never-published collect returned status {int(status)}")
    return elapsed


def sweep_variants(cfg, params) -> list[dict]:
    """Exchange-only time per (chunks per program, warps), over the batches."""
    from moe_front_jax.bridge import triton_mailbox as tm

    chosen = (tm.BLOCK_CHUNKS, tm.NUM_WARPS)
    rows = []
    for block, warps in [(32, 1), (64, 2), (128, 4), (256, 4), (256, 8)]:
        tm.BLOCK_CHUNKS, tm.NUM_WARPS = block, warps
        jax.clear_caches()
        row = dict(block=block, warps=warps)
        for batch in BATCHES:
            x = (jax.random.normal(jax.random.key(7), (batch, cfg.hidden)) + 0.1).astype(jnp.bfloat16)
            shard = mf.reference.front_gemm(x, params[0].packed, params[0].split, cfg.experts_per_rank)
            state = dict(box=mf.Mailbox.create(cfg, capacity=max(BATCHES)))

            def run(i):
                logits, latent, _, state["box"] = mb.exchange(state["box"], *shard)
                return logits, latent

            summary = summarize(kernel_times(run, ITERATIONS))
            row[batch] = (kernel_us(summary, "mailbox_publish"), kernel_us(summary, "mailbox_collect"))
        rows.append(row)
        print("variant", row, flush=True)
    tm.BLOCK_CHUNKS, tm.NUM_WARPS = chosen
    jax.clear_caches()
    return rows


def sweep_chunks(cfg, params, chunks: list[int]) -> list[dict]:
    """``route_collect``'s time per latent chunk (``route_collect.kernel.LATENT_CHUNK``) over the
    batches, after the front GEMM's publish."""
    chosen = route_collect_kernel.LATENT_CHUNK
    p = params[0]
    rows = []
    for chunk in chunks:
        route_collect_kernel.LATENT_CHUNK = chunk
        jax.clear_caches()
        row = dict(chunk=chunk)
        for batch in BATCHES:
            x = (jax.random.normal(jax.random.key(7), (batch, cfg.hidden)) + 0.1).astype(jnp.bfloat16)
            state = dict(box=mf.Mailbox.create(cfg, capacity=max(BATCHES)))

            @functools.partial(jax.jit, donate_argnums=0)
            def step(box):
                buffer, control, tickets, status = fg.front_gemm_publish(
                    x, p.packed, p.split, cfg.experts_per_rank, box.buffer, box.control,
                    box.tickets, cfg)
                *out, status, buffer, control = rc.route_collect(buffer, control, status, p.bias,
                                                                 batch, cfg)
                return out, status, mf.Mailbox(buffer, control, tickets, cfg)

            def run(i):
                out, status, state["box"] = step(state["box"])
                return out

            row[batch] = kernel_us(summarize(kernel_times(run, ITERATIONS)), "route_collect")
        rows.append(row)
        print("route_collect chunk", row, flush=True)
    route_collect_kernel.LATENT_CHUNK = chosen
    jax.clear_caches()
    return rows


TRANSPORT_BATCHES = (1, 8, 64)


def bench_transports(tp: int, batch: int) -> dict:
    """Exchange-only time per transport at ``tp`` ranks of Kimi-K3 and ``batch`` rows."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_front_jax import parallel

    cfg = mf.KIMI_K3.with_tp(tp)
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    ranks = NamedSharding(mesh, P("tp"))
    shards = []
    for i in range(COPIES):
        key = jax.random.key(300 + i)
        logits = jax.random.normal(key, (tp, batch, cfg.experts_per_rank), jnp.float32)
        latent = jax.random.normal(key, (tp, batch, cfg.latent_per_rank)).astype(jnp.bfloat16)
        shards.append(jax.device_put((logits, latent), ranks))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    def allgather(logits, latent):
        got_logits, got_latent = parallel.exchange(logits[0], latent[0], "tp")
        return got_logits[None], got_latent[None]

    def mailbox_step(transport):
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        @functools.partial(
            jax.shard_map, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False
        )
        def step(buffers, controls, logits, latent):
            box = mf.Mailbox(buffers[0], controls[0], one.tickets, cfg)
            got_logits, got_latent, status, box = mb.exchange(
                box, logits[0], latent[0], axis_name="tp", transport=transport
            )
            return box.buffer[None], box.control[None], got_logits[None], got_latent[None], status[None]

        one = mf.Mailbox.create(cfg, capacity=max(TRANSPORT_BATCHES))
        state = dict(
            buffers=jax.device_put(jnp.stack([one.buffer] * tp), ranks),
            controls=jax.device_put(jnp.stack([one.control] * tp), ranks),
            statuses=[],
        )

        def launch(i):
            state["buffers"], state["controls"], *out, status = step(
                state["buffers"], state["controls"], *shards[i % COPIES]
            )
            state["statuses"].append(status)
            return out

        return launch, state

    def per_device_us(calls) -> float:
        return statistics.median(sum(ms for _, ms in call) for call in calls) * 1e3 / tp

    row = dict(tp=tp, batch=batch, gathered_bytes=batch * (2 * cfg.latent + 4 * cfg.experts))
    calls = kernel_times(lambda i: allgather(*shards[i % COPIES]), ITERATIONS, allow_none=True)
    row["allgather_us"] = per_device_us(calls)
    row["allgather_kernels"] = sorted({name[:48] for call in calls for name, _ in call})
    for transport in ("peer", "gather") if tp == 1 else ("peer",):
        launch, state = mailbox_step(transport)
        calls = kernel_times(launch, ITERATIONS)
        statuses = {int(s) for status in state["statuses"] for s in np.asarray(status)}
        if statuses != {0}:
            raise RuntimeError(f"tp={tp} B={batch} {transport}: statuses {statuses}, expected 0")
        row[f"{transport}_us"] = per_device_us(calls)
        row[f"{transport}_kernels"] = sorted({name[:48] for call in calls for name, _ in call})
    print("transports", row, flush=True)
    return row


def main_transports(out: str) -> None:
    gpus = len(jax.devices())
    tps = [tp for tp in (1, 2, 4, 8, 16) if tp <= gpus]
    report = dict(device=jax.devices()[0].device_kind, gpus=gpus, jax=jax.__version__)
    report["transports"] = [bench_transports(tp, b) for tp in tps for b in TRANSPORT_BATCHES]
    with open(os.path.join(out, "bench_transports.json"), "w") as f:
        json.dump(report, f, indent=1)
    print()
    print(f"{report['device']} x{gpus}: exchange alone, CUPTI us per call and device (median of "
          f"{ITERATIONS})")
    print("| tp | B | allgather (XLA) | peer (Mosaic GPU + collect) | gather (jax-triton) "
          "| peer / allgather |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in report["transports"]:
        gather = f"{row['gather_us']:.2f}" if "gather_us" in row else "-"
        ratio = row["peer_us"] / row["allgather_us"] if row["allgather_us"] else float("inf")
        print(f"| {row['tp']} | {row['batch']} | {row['allgather_us']:.2f} | {row['peer_us']:.2f} | "
              f"{gather} | {ratio:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--variants", action="store_true", help="sweep the kernels' block size first")
    parser.add_argument("--chunks", default="",
                        help="comma-separated latent chunks to time route_collect at first")
    parser.add_argument("--transports", action="store_true",
                        help="time only the exchange per transport (allgather, peer, gather)")
    args = parser.parse_args()
    cfg = mf.KIMI_K3
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    if args.transports:
        main_transports(args.out)
        return
    params = [
        mf.pack_params(mf.init_weights(jax.random.key(i), cfg, shared=False), cfg) for i in range(COPIES)
    ]
    report = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
    if args.variants:
        report["variants"] = sweep_variants(cfg, params)
    if args.chunks:
        report["chunks"] = sweep_chunks(cfg, params, [int(c) for c in args.chunks.split(",")])
    report["timeout_s"] = {
        f"{name} B={batch}": timeout_seconds(cfg, batch, fused)
        for name, fused in (("collect", False), ("route_collect", True))
        for batch in (1, max(BATCHES))
    }
    report["batches"] = [bench_batch(batch, params, cfg) for batch in BATCHES]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_mailbox.json"), "w") as f:
        json.dump(report, f, indent=1)
    for row in report["batches"]:
        for path in ("mailbox", "mailbox_pallas"):
            kernels = [(name[:40], round(us, 2)) for name, us in row[path]["kernels"]]
            print(f"B={row['batch']} {path} path kernels (us):", kernels)
    print("timeout status after (s):", {b: round(s, 4) for b, s in report["timeout_s"].items()})
    print()
    print("Added = that path minus the direct path on the same backend (us per call). 'separate': "
          "collect + routing kernels; 'fused': route_collect; the publish by XLA's GEMM + the publish "
          "kernel ('auto' columns) or by the front GEMM's epilogue ('pallas' columns).")
    print("| B | direct | mailbox added | separate added | fused added | direct, pallas "
          "| mailbox added, pallas | separate added, pallas | fused added, pallas | front_gemm "
          "| front_gemm_publish | publish | collect | route | route_collect | plan adds, direct "
          "| plan adds, mailbox |")
    print("|" + " --- |" * 17)
    for row in report["batches"]:
        cells = [f"{row['direct']['us']:.2f}"]
        cells += [f"{row[f'{p}_added_us']:+.2f}" for p in ("mailbox", "separate", "fused")]
        cells += [f"{row['direct_pallas']['us']:.2f}"]
        cells += [f"{row[f'{p}_pallas_added_us']:+.2f}" for p in ("mailbox", "separate", "fused")]
        cells += [f"{row[k]:.2f}" for k in ("gemm_pallas_us", "gemm_publish_us", "publish_us",
                                             "collect_us", "route_us", "route_collect_pallas_us")]
        cells += [f"{row[k]:+.2f}" for k in ("plan_added_direct_us", "plan_added_mailbox_us")]
        print(f"| {row['batch']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
