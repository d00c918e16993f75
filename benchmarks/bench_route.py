"""Benchmark the Pallas routing kernels beside the XLA reference route on the GPU (CUPTI kernel time).

  python benchmarks/bench_route.py --out $OUT [--sweep] [--no-permute]
  python benchmarks/bench_route.py --check          # any machine: interpret mode, no timing

For B in {1, 8, 16, 32, 64, 128, 256} and the K3 config (896 experts, top-16): the kernel with its
shipped schedule (``route.pick_config``) and the XLA reference route (sigmoid, bias, ``lax.top_k``,
gather, renormalize; every kernel it launches summed), timed in the same process over rotated copies
of the logits, and the ratio XLA / kernel. With ``--sweep`` also every schedule of ``SWEEP`` (to
regenerate ``pallas/tuning/<device kind>/route.json``; both selections, argmax and groups, side
by side), written to $OUT/bench_route_sweep.json with each schedule's fraction of rows whose ids
equal the reference's.
The Mosaic GPU kernels (``route_mosaic``, ``permutation_mosaic``: "mosaic", "mosaic_permute",
"mosaic_order") run beside the Triton ones in the same process, their ids and orders checked the
same way; the tables give their time over the Triton kernel's (issue 47's target: at most 1.1).
The results go to $OUT/bench_route.json in benchmarks/README.md's format (stage "route"); the table
prints last.

The dispatch order (SPEC section 4.1, unless ``--no-permute``), in the same run: the routing kernel
writing it in its launch (``route(..., permute=True)``, "pallas_permute") beside the kernel routing
alone ("pallas") and beside XLA's way ("xla_permute": the reference's ``lax.top_k``, gather, then a
stable argsort of the ids, a histogram and the inverse scatter), and the standalone kernel over given
ids ("order", what runs after ``route_collect``). Each timed order is checked bit-equal to the
reference's order of the kernel's own ids; each kernel's median time goes beside (the workspace's
zero fill apart from the routing kernel). Rows go to $OUT/bench_route_permute.json (stage
"route_permute", its bytes ``route_bytes + permute_bytes``); its table prints after the routing's,
with the issue's targets: at most 1.5 us above routing alone for B <= 64, at most 6 us in all at
B = 256, at least 4x XLA's way at every B.

``--families`` (issues 45 and 47): at B in {1, 8, 64}, in one process, the Mosaic GPU kernel at
its default schedule for each family of ``FAMILIES`` (Kimi-K3, DeepSeek-V3's groups, Qwen3's softmax,
Kimi-K2, GLM-4.5), XLA's reference route for each, the Triton kernel where it covers the family
(sigmoid without dropped groups), and every schedule of ``MOSAIC_VARIANTS`` at Kimi-K3 and
DeepSeek-V3; each timed kernel's ids are checked against XLA's on the same rows. The table prints
last, with the targets: DeepSeek-V3 / Kimi-K3 at most 1.2 (B <= 64), XLA / kernel at least 4, Mosaic
/ Triton at Kimi-K3 at most 1.1. Results: $OUT/bench_route_families.json (stage "route_families",
each row naming its family and schedule).

``--check``: on any machine, every variant with the kernels in interpret mode, no timing; with
``--families``, every variant of the families part, ids and weights bit-equal to the reference.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

import moe_front_jax as mf
from moe_front_jax import reference
from moe_front_jax.pallas import route as rt
from moe_front_jax.reference import routing as reference_routing
import timing
from timing import READ_CEILING_TBS

COPIES = 16
"""Logits copies rotated through (each call reads logits no earlier call just wrote or read)."""
SWEEP = [rt.RouteConfig(rows, warps) for rows, warps in
         ((1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 4), (4, 8))] + [
    rt.RouteConfig(rows, warps, "groups", group, width) for rows, warps, group, width in (
        (1, 2, 0, 0), (1, 4, 0, 0), (1, 8, 0, 0), (2, 4, 0, 0), (2, 8, 0, 0), (4, 8, 0, 0),
        (1, 4, 8, 8), (1, 8, 8, 8), (1, 4, 16, 8), (1, 8, 32, 0),
    )
]
"""Schedules ``--sweep`` times: argmax over rows and warps, then the groups selection with
``group_plan``'s sizes over rows and warps and a few other plans (8-lane groups ranked once,
``(8,)``; ``(16, 8)``; ``(32, 8, 4)``), each labelled by ``RouteConfig.name``."""
TARGET_US = {1: 3.0, 8: 3.0, 16: 3.0, 32: 3.0, 64: 3.0, 256: 5.0}
"""The issue's targets per B (none set at B=128)."""
PERMUTE_ADDED_US, PERMUTE_TOTAL_US, PERMUTE_RATIO = 1.5, 6.0, 4.0
"""The order's targets: at most 1.5 us above routing alone for B <= 64, at most 6 us in all at
B = 256, at least 4x XLA's route + argsort at every B."""


ORDERS = ("order", "mosaic_order")
"""The variants that take ids rather than logits."""


def route_variants(cfg, interpret: bool = False) -> dict:
    """Routing alone, each ``fn(bias, logits)``: the Triton kernel, XLA, the Mosaic GPU kernel."""
    return {"pallas": lambda b, l: rt.route(l, b, cfg, interpret=interpret),
            "xla": lambda b, l: reference.route(l, b, cfg),
            "mosaic": lambda b, l: rt.route_mosaic(l, b, cfg, interpret=interpret)}


def permute_variants(cfg, interpret: bool = False) -> dict:
    """The order's variants, each ``fn(bias, x)`` with ``x`` the logits (the ids for ``ORDERS``)."""
    return {
        "pallas_permute": lambda b, l: rt.route(l, b, cfg, permute=True, interpret=interpret),
        "xla_permute": lambda b, l: reference.route(l, b, cfg, permute=True),
        "order": lambda b, ids: rt.permutation(ids, cfg, interpret=interpret),
        "mosaic_permute": lambda b, l: rt.route_mosaic(l, b, cfg, permute=True,
                                                       interpret=interpret),
        "mosaic_order": lambda b, ids: rt.permutation_mosaic(ids, cfg, interpret=interpret),
    }


FAMILIES = ("KIMI_K3", "DEEPSEEK_V3", "QWEN3_30B_A3B", "KIMI_K2", "GLM_4_5")
"""The presets ``--families`` times (``mf.configs.PRESETS`` names); Mixtral's 8 experts are not a
multiple of the Mosaic kernel's 32 lanes."""
FAMILY_BATCHES = "1,8,64"
MOSAIC = rt.mosaic.MosaicRouteConfig
MOSAIC_VARIANTS = (
    MOSAIC(), MOSAIC(unroll=16), MOSAIC(split=True), MOSAIC(lane_weights=True),
    MOSAIC(split=True, lane_weights=True), MOSAIC(split=True, lane_weights=True, cached=2),
    MOSAIC(split=True, lane_weights=True, cached=4), MOSAIC(split=True, lane_weights=True, unroll=2),
    MOSAIC(split=True, lane_weights=True, warpgroups=2),
    MOSAIC(split=True, lane_weights=True, warpgroups=4),
    MOSAIC(split=True, lane_weights=True, steps=2),
)
"""The Mosaic GPU kernel's schedules ``--families`` times at Kimi-K3 and DeepSeek-V3, the default
first: the selection rounds unrolled as before (``unroll=16``), the keys split over the warps, the
weights one a lane, both, and with both each lane's cache depth, two rounds a step, two and four
rows a CTA side by side or two one after another."""
GROUPED_OVER_PLAIN, XLA_OVER_KERNEL, MOSAIC_OVER_TRITON = 1.2, 4.0, 1.1
"""The targets: DeepSeek-V3's time over Kimi-K3's (issue 45, B <= 64), XLA's route over the kernel's
(issue 45), the Mosaic GPU kernel's over the Triton kernel's at Kimi-K3 (issue 47)."""


def family_variants(interpret: bool = False) -> dict:
    """``(family, backend, schedule)`` -> ``(cfg, fn(bias, logits))`` for ``--families``: "xla"
    and "mosaic" (its default schedule) for every family, "triton" where it covers the family,
    "mosaic" at each of ``MOSAIC_VARIANTS`` for Kimi-K3 and DeepSeek-V3. Schedules name Mosaic's
    ``MosaicRouteConfig`` (empty for the others)."""
    variants = {}
    for family in FAMILIES:
        cfg = mf.configs.PRESETS[family]
        variants[family, "xla", ""] = cfg, lambda b, l, cfg=cfg: reference.route(l, b, cfg)
        try:
            rt.kernel.check_plain_routing(cfg)
            variants[family, "triton", ""] = cfg, lambda b, l, cfg=cfg: rt.route(
                l, b, cfg, interpret=interpret)
        except NotImplementedError:
            pass
        configs = MOSAIC_VARIANTS if family in ("KIMI_K3", "DEEPSEEK_V3") else MOSAIC_VARIANTS[:1]
        for c in configs:
            variants[family, "mosaic", c.name] = cfg, lambda b, l, cfg=cfg, c=c: rt.route_mosaic(
                l, b, cfg, config=c, interpret=interpret)
    return variants


def family_inputs(cfg, batch: int, copies: int):
    """The bias and ``copies`` random logits ``[batch, E]`` of a family."""
    bias = jax.random.uniform(jax.random.key(3), (cfg.experts,), jnp.float32, -0.05, 0.05)
    return bias, [jax.random.normal(k, (batch, cfg.experts), jnp.float32) * 2
                  for k in jax.random.split(jax.random.key(batch), copies)]


def check_families(batches: list[int]) -> None:
    """``--check --families``: every variant in interpret mode, ids and weights bit-equal to XLA's
    reference on the same rows."""
    variants = family_variants(interpret=True)
    kernels = {key: v for key, v in variants.items() if key[1] != "xla"}
    for batch in batches:
        wants = {}
        for (family, backend, schedule), (cfg, fn) in kernels.items():
            if family not in wants:
                bias, (logits,) = family_inputs(cfg, batch, 1)
                wants[family] = bias, logits, jax.jit(variants[family, "xla", ""][1])(bias, logits)
            bias, logits, want = wants[family]
            got = jax.jit(fn)(bias, logits)
            if not all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want)):
                raise SystemExit(f"--check --families failed: {family} {backend} {schedule} "
                                 f"B={batch}")
        print(f"B={batch}: {len(kernels)} kernel variants bit-equal to the reference", flush=True)
    print("check ok")


def time_families(batches: list[int], out: str) -> None:
    """``--families`` on the GPU: compile every variant, time them batch by batch (CUPTI), check
    their ids against XLA's, write the JSON, print the tables."""
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    variants = family_variants()
    inputs = {(family, batch): family_inputs(mf.configs.PRESETS[family], batch, COPIES)
              for family in FAMILIES for batch in batches}
    keys = [(key, batch) for batch in batches for key in variants]

    def compile_one(item):
        (family, backend, schedule), batch = item
        bias, logits = inputs[family, batch]
        fn = variants[family, backend, schedule][1]
        return jax.jit(fn).lower(bias, logits[0]).compile()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = dict(zip(keys, pool.map(compile_one, keys)))
    rows = []
    for batch in batches:
        for key in variants:
            family, backend, schedule = key
            bias, logits = inputs[family, batch]
            per_kernel = timing.cupti_us_per_kernel(compiled[key, batch], bias, logits, rounds=4)
            ids = compiled[key, batch](bias, logits[0])[0]
            want = compiled[(family, "xla", ""), batch](bias, logits[0])[0]
            cfg = variants[key][0]
            call_us = statistics.median(map(sum, zip(*per_kernel.values())))
            rows.append(dict(
                stage="route_families", backend=backend, tp=1, batch=batch, family=family,
                schedule=schedule, time_us=round(call_us, 3),
                kernels={k: round(statistics.median(us), 3) for k, us in per_kernel.items()},
                ids_agree=float(jnp.mean(jnp.all(ids == want, axis=1))),
                bytes=rt.route_bytes(batch, cfg.experts, cfg.top_k,
                                     bias=cfg.scoring == "sigmoid")))
        print(f"B={batch}: {len(variants)} variants timed", flush=True)
    timing.write_result(out, "bench_route_families", device.device_kind, rows, "route_families",
                        READ_CEILING_TBS, f"HBM read {READ_CEILING_TBS} TB/s")
    print_families_tables(rows, batches, device.device_kind)


def print_families_tables(rows: list[dict], batches: list[int], device_kind: str) -> None:
    """The families at Mosaic's default schedule, then each schedule at Kimi-K3 and DeepSeek-V3,
    with the targets' ratios."""
    t = {(r["family"], r["backend"], r["schedule"], r["batch"]): r for r in rows}
    default = MOSAIC_VARIANTS[0].name
    print(f"\nroute families, {device_kind}, {time.strftime('%Y-%m-%d')}, CUPTI kernel time per call "
          f"(us); mosaic at {default}; /K3: over Kimi-K3's (DeepSeek-V3: <= {GROUPED_OVER_PLAIN})")
    print(f"{'family':<14} {'B':>3} {'mosaic':>7} {'ids==xla':>8} {'/K3':>5} {'xla':>7} "
          f"{'xla/mosaic':>10} {'>=4':>4} {'triton':>7} {'mosaic/triton':>13} {'<=1.1':>5}")
    for family in FAMILIES:
        for batch in batches:
            m, x = t[family, "mosaic", default, batch], t[family, "xla", "", batch]
            tr = t.get((family, "triton", "", batch))
            ratio = x["time_us"] / m["time_us"]
            plain = m["time_us"] / t["KIMI_K3", "mosaic", default, batch]["time_us"]
            line = (f"{family:<14} {batch:>3} {m['time_us']:>7.2f} {m['ids_agree']:>8.3f} "
                    f"{plain:>5.2f} {x['time_us']:>7.2f} {ratio:>10.2f} "
                    f"{'yes' if ratio >= XLA_OVER_KERNEL else 'NO':>4}")
            if tr is not None:
                over = m["time_us"] / tr["time_us"]
                line += (f" {tr['time_us']:>7.2f} {over:>13.2f} "
                         f"{'yes' if over <= MOSAIC_OVER_TRITON else 'NO':>5}")
            print(line)
    print(f"\nmosaic schedules: Kimi-K3 us (over triton, <= {MOSAIC_OVER_TRITON}), DeepSeek-V3 us "
          f"(over Kimi-K3, <= {GROUPED_OVER_PLAIN}), ids==xla the least of both")
    print(f"{'schedule':<12}" + "".join(f" {'B=' + str(b):>26}" for b in batches))
    for c in MOSAIC_VARIANTS:
        cells = []
        for batch in batches:
            k3 = t["KIMI_K3", "mosaic", c.name, batch]
            ds = t["DEEPSEEK_V3", "mosaic", c.name, batch]
            tr = t["KIMI_K3", "triton", "", batch]
            agree = min(k3["ids_agree"], ds["ids_agree"])
            cells.append(f"{k3['time_us']:.2f} ({k3['time_us'] / tr['time_us']:.2f}) "
                         f"{ds['time_us']:.2f} ({ds['time_us'] / k3['time_us']:.2f}) {agree:.3f}")
        print(f"{c.name:<12}" + "".join(f" {cell:>26}" for cell in cells))


def order_agrees(route_out, cfg) -> bool:
    """Whether a routing call's order, group sizes and inverse equal the reference's of its ids."""
    ids, _, *got = route_out
    want = reference_routing.permutation(ids, cfg)
    return all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want))


def check(batches: list[int]) -> None:
    """``--check``: each variant on this machine, the kernels in interpret mode; no timing."""
    cfg = mf.KIMI_K3
    bias = jax.random.uniform(jax.random.key(3), (cfg.experts,), jnp.float32, -0.05, 0.05)
    variants = {**route_variants(cfg, interpret=True), **permute_variants(cfg, interpret=True)}
    for batch in batches:
        logits = jax.random.normal(jax.random.key(batch), (batch, cfg.experts), jnp.float32) * 2
        want = jax.jit(variants["xla"])(bias, logits)
        outs = {name: jax.jit(fn)(bias, want[0] if name in ORDERS else logits)
                for name, fn in variants.items()}
        same_ids = all(bool(jnp.array_equal(outs[n][0], want[0])) for n in variants
                       if n not in ORDERS)
        orders = [order_agrees(outs[n], cfg) for n in ("pallas_permute", "xla_permute",
                                                       "mosaic_permute")]
        orders += [all(bool(jnp.array_equal(g, w)) for g, w in
                       zip(outs[n], reference_routing.permutation(want[0], cfg))) for n in ORDERS]
        ok = same_ids and all(orders)
        print(f"B={batch}: {len(variants)} variants ran; ids agree {same_ids}, orders agree "
              f"{all(orders)}", flush=True)
        if not ok:
            raise SystemExit(f"--check failed at B={batch}")
    print("check ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="1,8,16,32,64,128,256")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-permute", action="store_true", help="time routing alone")
    parser.add_argument("--check", action="store_true",
                        help="run every variant in interpret mode at small batches, no timing")
    parser.add_argument("--families", action="store_true",
                        help="the routing families and the Mosaic kernel's schedules (B 1,8,64)")
    args = parser.parse_args()
    default = args.batches == parser.get_default("batches")
    if args.families:
        batches = list(map(int, (FAMILY_BATCHES if default else args.batches).split(",")))
        (check_families if args.check else lambda b: time_families(b, args.out))(batches)
        return
    if args.check:
        check([1, 3, 8] if default else list(map(int, args.batches.split(","))))
        return
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    cfg = mf.KIMI_K3
    batches = list(map(int, args.batches.split(",")))
    bias = jax.random.uniform(jax.random.key(3), (cfg.experts,), jnp.float32, -0.05, 0.05)
    logits = {
        batch: [
            jax.random.normal(k, (batch, cfg.experts), jnp.float32) * 2
            for k in jax.random.split(jax.random.key(batch), COPIES)
        ]
        for batch in batches
    }
    variants = {name: (lambda fn: lambda batch: fn)(fn)
                for name, fn in route_variants(cfg).items()}
    if not args.no_permute:
        for name, fn in permute_variants(cfg).items():
            variants[name] = (lambda fn: lambda batch: fn)(fn)
    if args.sweep:
        for c in SWEEP:
            variants[c.name] = (
                lambda c: lambda batch: (lambda b, l: rt.route(l, b, cfg, config=c))
            )(c)
    keys = [(batch, name) for batch in batches for name in variants]
    # The standalone order's input: the reference's ids of each logits copy.
    ids = {} if args.no_permute else {
        batch: [jax.jit(lambda l: reference.route(l, bias, cfg)[0])(l) for l in logits[batch]]
        for batch in batches}

    def inputs(batch, name):
        return ids[batch] if name in ORDERS else logits[batch]

    def compile_one(key):
        batch, name = key
        return jax.jit(variants[name](batch)).lower(bias, inputs(batch, name)[0]).compile()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = dict(zip(keys, pool.map(compile_one, keys)))
    times, kernels = {}, {}
    for batch in batches:
        # The XLA reference and the kernel back to back: a drift of the shared machine hits both.
        for name in variants:
            per_kernel = timing.cupti_us_per_kernel(compiled[batch, name], bias,
                                                    inputs(batch, name), rounds=8)
            times[batch, name] = statistics.median(map(sum, zip(*per_kernel.values())))
            kernels[batch, name] = {k: round(statistics.median(us), 3) for k, us in per_kernel.items()}
        print(json.dumps({"batch": batch, **{n: round(times[batch, n], 3) for n in variants},
                          **{f"{n}_kernels": kernels[batch, n] for n in variants
                             if n not in ("xla", "pallas", "mosaic")}}), flush=True)

    # Check while timing: the timed kernel's ids equal the reference's on these rows (random normals;
    # the GPU test covers near ties).
    agree = {}
    for batch in batches:
        want = compiled[batch, "xla"](bias, logits[batch][0])[0]
        for name in variants:
            if name not in ("xla", "xla_permute", *ORDERS):
                got = compiled[batch, name](bias, logits[batch][0])[0]
                agree[batch, name] = float(jnp.mean(jnp.all(got == want, axis=1)))
    # The timed orders equal the reference's order of their own ids, bit for bit.
    orders = {}
    for batch in batches if not args.no_permute else []:
        for kind, routed, alone in (("pallas", "pallas_permute", "order"),
                                    ("mosaic", "mosaic_permute", "mosaic_order")):
            orders[batch, kind] = (
                order_agrees(compiled[batch, routed](bias, logits[batch][0]), cfg)
                and all(bool(jnp.array_equal(g, w)) for g, w in zip(
                    compiled[batch, alone](bias, ids[batch][0]),
                    reference_routing.permutation(ids[batch][0], cfg))))

    rows = []
    for batch in batches:
        for backend in ("pallas", "xla", "mosaic"):
            rows.append(dict(stage="route", backend=backend, tp=1, batch=batch,
                             time_us=round(times[batch, backend], 3),
                             bytes=rt.route_bytes(batch, cfg.experts, cfg.top_k)))
    timing.write_result(args.out, "bench_route", device.device_kind, rows, "route",
                        READ_CEILING_TBS, f"HBM read {READ_CEILING_TBS} TB/s")
    if not args.no_permute:
        permute_rows = [
            dict(stage="route_permute", backend=backend, tp=1, batch=batch,
                 time_us=round(times[batch, f"{backend}_permute"], 3),
                 bytes=rt.route_bytes(batch, cfg.experts, cfg.top_k)
                 + (rt.mosaic.permute_bytes if backend == "mosaic" else rt.permute_bytes)(
                     batch, cfg.experts, cfg.top_k))
            for batch in batches for backend in ("pallas", "xla", "mosaic")]
        detail = [dict(batch=batch, route_us=round(times[batch, "pallas"], 3),
                       order_alone_us=round(times[batch, "order"], 3),
                       xla_route_us=round(times[batch, "xla"], 3),
                       xla_permute_kernels=kernels[batch, "xla_permute"],
                       pallas_permute_kernels=kernels[batch, "pallas_permute"],
                       order_kernels=kernels[batch, "order"],
                       order_equals_reference=orders[batch, "pallas"],
                       mosaic_route_us=round(times[batch, "mosaic"], 3),
                       mosaic_order_alone_us=round(times[batch, "mosaic_order"], 3),
                       mosaic_permute_kernels=kernels[batch, "mosaic_permute"],
                       mosaic_order_equals_reference=orders[batch, "mosaic"])
                  for batch in batches]
        timing.write_result(args.out, "bench_route_permute", device.device_kind, permute_rows,
                            "route_permute", READ_CEILING_TBS, f"HBM read {READ_CEILING_TBS} TB/s",
                            detail=detail)
    if args.sweep:
        sweep = {str(batch): {n: times[batch, n] for n in variants} for batch in batches}
        # Fraction of rows whose ids equal the XLA reference's, per schedule (as "ids==xla" below).
        sweep["ids_agree"] = {str(batch): {n: agree[batch, n] for n in variants if (batch, n) in agree}
                              for batch in batches}
        with open(os.path.join(args.out, "bench_route_sweep.json"), "w") as f:
            json.dump(sweep, f, indent=1)
        names = [c.name for c in SWEEP]
        width = max(7, *map(len, names))

        def line(label, cells):
            print(f"{label:<12}" + " ".join(f"{c:>{width}}" for c in cells))

        print()
        line("sweep (us)", names)
        for batch in batches:
            line(f"  B={batch}", [f"{times[batch, n]:.2f}" for n in names])
        line("  ids==xla", [f"{min(agree[b, n] for b in batches):.3f}" for n in names])

    configs = {b: rt.pick_config(b, cfg.experts, cfg.top_k) for b in batches}
    print(f"\nroute, K3 (896 experts, top-16), {device.device_kind}, {time.strftime('%Y-%m-%d')}, "
          "CUPTI kernel time per call")
    print(f"{'B':>4} {'pallas us':>10} {'xla us':>8} {'xla/pallas':>10} {'target us':>9} "
          f"{'met':>4} {'ids==xla':>8} {'mosaic us':>9} {'mosaic/pallas':>13} {'ids==xla':>8}  "
          "config")
    for batch in batches:
        k, x = times[batch, "pallas"], times[batch, "xla"]
        target = TARGET_US.get(batch)
        met = "-" if target is None else ("yes" if k <= target and x / k >= 4 else "NO")
        if target is None:
            met = "yes" if x / k >= 4 else "NO"
        m = times[batch, "mosaic"]
        print(f"{batch:>4} {k:>10.2f} {x:>8.2f} {x / k:>10.2f} {target or '-':>9} {met:>4} "
              f"{agree[batch, 'pallas']:>8.3f} {m:>9.2f} {m / k:>13.2f} "
              f"{agree[batch, 'mosaic']:>8.3f}  {configs[batch].name} ({configs[batch].select})")
    if not args.no_permute:
        print_permute_table(batches, times, orders, device.device_kind)


def permute_targets(batch: int, alone: float, permuted: float, xla: float) -> bool:
    """Whether the order meets the issue's targets at ``batch`` (microseconds in)."""
    met = xla / permuted >= PERMUTE_RATIO
    if batch <= 64:
        met = met and permuted - alone <= PERMUTE_ADDED_US
    if batch == 256:
        met = met and permuted <= PERMUTE_TOTAL_US
    return met


def print_permute_table(batches, times, orders, device_kind: str) -> None:
    print(f"\nroute + dispatch order, K3 (896 experts, top-16), {device_kind}, "
          f"{time.strftime('%Y-%m-%d')}, CUPTI kernel time per call")
    print(f"{'B':>4} {'route us':>9} {'+order us':>9} {'added us':>8} {'xla+argsort us':>14} "
          f"{'xla/ours':>8} {'order alone':>11} {'met':>4} {'order==ref':>10} "
          f"{'mosaic +order':>13} {'mosaic order':>12} {'mosaic/pallas':>13} {'==ref':>5}")
    for batch in batches:
        alone, permuted = times[batch, "pallas"], times[batch, "pallas_permute"]
        xla = times[batch, "xla_permute"]
        met = "yes" if permute_targets(batch, alone, permuted, xla) else "NO"
        mosaic = times[batch, "mosaic_permute"]
        print(f"{batch:>4} {alone:>9.2f} {permuted:>9.2f} {permuted - alone:>8.2f} {xla:>14.2f} "
              f"{xla / permuted:>8.2f} {times[batch, 'order']:>11.2f} {met:>4} "
              f"{str(orders[batch, 'pallas']):>10} {mosaic:>13.2f} "
              f"{times[batch, 'mosaic_order']:>12.2f} {mosaic / permuted:>13.2f} "
              f"{str(orders[batch, 'mosaic']):>5}")


if __name__ == "__main__":
    main()
