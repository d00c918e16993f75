"""Time the tensor-parallel front per call: the exchange alone, and the whole sharded front.

For each tp (a power of two up to the device count) and batch B, on a ``"tp"`` mesh of the first tp
devices:

- ``exchange``: ``parallel.exchange`` alone under ``jax.shard_map``, ONE XLA all-gather of every rank's
  ``[B, L/tp + 2E/tp]`` 16-bit mailbox row; its bytes per device are the whole gathered row,
  ``B * (L + 2E) * 2``;
- ``front``: ``moe_front`` on ``shard_params``' output (front GEMM on each shard, the exchange,
  routing of all experts, the shared expert reduced by ``psum`` or ``psum_scatter``), per backend;
- ``unsharded``: the XLA reference front on one device (``pack_params``, tp=1), timed in the same
  process so that the ratio survives the drift of a shared machine.

On a GPU the time is CUPTI's summed kernel time (``jax.experimental.mosaic.gpu.profiler.measure``)
divided by the devices that ran kernels, i.e. the mean device time of one call; for the collectives
it includes the time a rank waits for its peers. ``wall`` is the host clock over back-to-back calls.
Weights rotate over enough copies that each device reads more than three times its L2 per round. On
CPU (``--cpu-devices 8``, to check the script) only the wall clock exists.

    python benchmarks/bench_tp.py                          # on the GPUs: K3, tp 2..#GPUs, B 1 8 64
    python benchmarks/bench_tp.py --cpu-devices 8 --config small --repeats 3   # a CPU check

The table is printed last; the full results go to ``--out`` (default ``$OUT/bench_tp.json`` when $OUT
is set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

L2_BYTES = 60 * 2**20
"""H200 L2: the weights one device reads per round must exceed it three times over."""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("k3", "small"), default="k3")
    parser.add_argument("--tp", type=int, nargs="+", help="default: 2, 4, ... up to the devices")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--backends", nargs="+", default=None,
                        help="front backends; default xla, plus auto on a GPU")
    parser.add_argument("--repeats", type=int, default=20, help="measurements per point (median)")
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="run on this many virtual CPU devices instead of the GPUs")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        )
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import moe_front_jax as mf
    from moe_front_jax import parallel

    on_gpu = jax.default_backend() == "gpu"
    cfg = mf.KIMI_K3 if args.config == "k3" else mf.FrontConfig(
        hidden=1024, experts=128, top_k=16, latent=512, shared=512
    )
    devices = jax.devices()
    tps = args.tp or [2**i for i in range(1, 5) if 2**i <= len(devices)]
    backends = args.backends or (["xla", "auto"] if on_gpu else ["xla"])
    if on_gpu:
        from jax.experimental.mosaic.gpu import profiler

    def device_time_us(fn, fn_args, calls, ran_on):
        """Median over repeats of the mean device time of one call, and the host wall clock."""
        jax.block_until_ready(fn(*fn_args))
        wall = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            wall.append((time.perf_counter() - start) * 1e6 / calls)
        result = {"wall_us": statistics.median(wall)}
        if on_gpu:
            kernel = []
            for _ in range(args.repeats):
                _, ms = profiler.measure(fn, aggregate=True)(*fn_args)
                kernel.append(ms * 1e3 / calls / ran_on)
            result["kernel_us"] = statistics.median(kernel)
        return result

    def copies_for(bytes_per_device):
        return max(1, math.ceil(3 * L2_BYTES / bytes_per_device)) if on_gpu else 1

    def weight_copies(n):
        return [mf.init_weights(jax.random.key(seed), cfg) for seed in range(n)]

    unsharded_bytes = 2 * cfg.hidden * (cfg.experts + cfg.latent + 3 * cfg.shared)
    single = [mf.pack_params(w, cfg) for w in weight_copies(copies_for(unsharded_bytes))]

    @jax.jit
    def unsharded_calls(x, params_list):
        return [mf.moe_front(x, p, backend="xla") for p in params_list]

    def batch_rows(b):
        x = jax.random.normal(jax.random.key(1000 + b), (b, cfg.hidden), jnp.float32)
        return x.astype(jnp.bfloat16)

    unsharded = {
        b: device_time_us(unsharded_calls, (jax.device_put(batch_rows(b), devices[0]), single),
                          len(single), 1)
        for b in args.batches
    }
    rows = []
    for tp in tps:
        if tp > len(devices):
            sys.exit(f"--tp {tp} needs {tp} devices, only {len(devices)} here")
        mesh = jax.make_mesh((tp,), ("tp",), devices=devices[:tp])
        per_device = unsharded_bytes // tp
        sharded = [mf.shard_params(w, cfg, mesh) for w in weight_copies(copies_for(per_device))]
        exchange = jax.jit(
            jax.shard_map(
                lambda logits, latent: parallel.exchange(logits, latent, "tp"),
                mesh=mesh,
                in_specs=(P(None, "tp"), P(None, "tp")),
                out_specs=(P(), P()),
            )
        )
        columns = NamedSharding(mesh, P(None, "tp"))
        for b in args.batches:
            key = jax.random.key(2000 + b)
            x = jax.device_put(batch_rows(b), NamedSharding(mesh, P()))
            logits = jax.device_put(jax.random.normal(key, (b, cfg.experts), jnp.float32), columns)
            latent = jax.random.normal(key, (b, cfg.latent), jnp.float32).astype(jnp.bfloat16)
            latent = jax.device_put(latent, columns)
            row_bytes = b * (cfg.latent + 2 * cfg.experts) * 2
            point = {
                "tp": tp, "batch": b, "copies": len(sharded), "exchange_bytes": row_bytes,
                "exchange": device_time_us(exchange, (logits, latent), 1, tp),
                "unsharded": unsharded[b],
            }
            for backend in backends:
                for reduce in ("psum", "psum_scatter"):
                    calls = jax.jit(
                        lambda x, params_list, backend=backend, reduce=reduce: [
                            mf.moe_front(x, p, backend=backend, shared_reduce=reduce)
                            for p in params_list
                        ]
                    )
                    point[f"front_{backend}_{reduce}"] = device_time_us(
                        calls, (x, sharded), len(sharded), tp
                    )
            rows.append(point)
            print(json.dumps(point), flush=True)

    out = args.out
    if out is None and "OUT" in os.environ:
        out = os.path.join(os.environ["OUT"], "bench_tp.json")
    meta = {
        "device": str(devices[0].device_kind), "devices": len(devices), "jax": jax.__version__,
        "config": dataclasses.asdict(cfg), "timer": "cupti" if on_gpu else "wall", "rows": rows,
    }
    if out:
        with open(out, "w") as f:
            json.dump(meta, f, indent=1)

    clock = "kernel_us" if on_gpu else "wall_us"
    fronts = [k for k in rows[0] if k.startswith("front_")]
    header = ["tp", "B", "exchange", "GB/s"] + [k[len("front_"):] for k in fronts] + [
        "unsharded", "unsharded/front"]
    print(f"\n{devices[0].device_kind} x{len(devices)}, {args.config}, {clock} per call (median "
          f"of {args.repeats}); GB/s: gathered bytes per device / exchange time")
    print(" | ".join(header))
    for r in rows:
        ex = r["exchange"][clock]
        front = r[fronts[0]][clock]
        cells = [r["tp"], r["batch"], f"{ex:.1f}", f"{r['exchange_bytes'] / ex / 1e3:.2f}"]
        cells += [f"{r[k][clock]:.1f}" for k in fronts]
        cells += [f"{r['unsharded'][clock]:.1f}", f"{r['unsharded'][clock] / front:.2f}"]
        print(" | ".join(map(str, cells)))


if __name__ == "__main__":
    main()
