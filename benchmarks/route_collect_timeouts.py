"""Time out ``route_collect`` on a never-published mailbox, call after call, and check its ids.

  python benchmarks/route_collect_timeouts.py --select argmax --batch 256 --calls 4 [--spins N]

Every program of the kernel polls its row ``--spins`` times, reports the timeout, then routes the row
it holds: the sentinel words, logits of -0.0, so every row's ids must be ``route.route``'s ids of a
row of -0.0 under the same bias and schedule. Prints, per call, the status, the rows whose ids
differ (and two of them in full), and whether the logits and latent came back as the sentinel. This
is how the warp-divergent poll loop was found (benchmarks/RESULTS.md, fourth session): rows polled
tens of thousands of times came out with duplicate or out-of-range ids at B > 1 and not at B = 1.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import moe_front_jax as mf
from moe_front_jax.bridge import mailbox as mb
from moe_front_jax.pallas import route as rt
from moe_front_jax.pallas import route_collect as rc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--select", choices=("argmax", "groups"), default="groups")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--spins", type=int, default=rc.SPIN_LIMIT)
    args = parser.parse_args()
    cfg, batch = mf.KIMI_K3, args.batch
    bias = jax.random.normal(jax.random.key(3), (cfg.experts,), jnp.float32) * 0.1
    picked = rt.pick_config(batch, cfg.experts, cfg.top_k)
    config = rt.RouteConfig(picked.block_rows, picked.num_warps, args.select)
    run = jax.jit(
        lambda box, status: rc.route_collect(
            box, status, bias, batch, config=config, spin_limit=args.spins
        ),
        donate_argnums=0,
    )
    box = mf.Mailbox.create(cfg, capacity=max(batch, 256))
    sentinel_rows = jnp.full((batch, cfg.experts), -0.0, jnp.float32)
    want = np.asarray(rt.route(sentinel_rows, bias, cfg, config=config)[0])
    print(f"{jax.devices()[0].device_kind}: route_collect {config.name}, B={batch}, "
          f"{args.spins} polls a row", flush=True)
    for call in range(args.calls):
        ids, _, logits, latent, status, box = jax.block_until_ready(
            run(box, jnp.zeros((), jnp.int32))
        )
        ids = np.asarray(ids)
        bad = np.nonzero((ids != want).any(axis=1))[0]
        logits_armed = bool((np.asarray(logits).view(np.uint32) == mb.SENTINEL).all())
        print(f"call {call}: status {int(status)}, rows with other ids {bad.tolist()[:12]} "
              f"({len(bad)}), logits all sentinel {logits_armed}", flush=True)
        for row in bad[:2]:
            print(f"  row {row}: ids {ids[row].tolist()}\n  want      {want[row].tolist()}")


if __name__ == "__main__":
    main()
