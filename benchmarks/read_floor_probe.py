"""How fast can any kernel we can write read the shared expert's tp8 weights? (GPU; ``--interpret``
on the CPU.)

  python benchmarks/read_floor_probe.py --out $OUT [--sizes both8,gate_up8,down8] [--interpret]

Issue 7 asks the tp8 shared expert (gate/up, situ, down) for B <= 64 in at most 9 us on the H200.
Its two weights are 33.0 MB; XLA's row sum of them as one array takes 8.88 us there (thirteenth
session, ``read_by_size.py``), and the down cannot start before the last gate/up row is done. If no
plain read of the 33 MB can beat 9 us by the cost of that hand-off, the target is below what the
chip gives. XLA's row sum is one kernel of one design; this probe sweeps two more families of plain
reads of the same bytes, each reading the weight as a flat array and keeping nothing but a sum:

- ``triton``: a Pallas Triton kernel of ``G`` programs; program ``p`` loads ``[rows, 1024]`` blocks
  ``p, p + G, p + 2G, ...`` (each 16-64 KiB, contiguous) in a loop that Triton pipelines
  ``stages`` deep, and adds them up in float32.
- ``tma``: a Mosaic GPU kernel of ``G`` CTAs; CTA ``c`` copies ``[rows, 256]`` boxes
  ``c, c + G, ...`` (contiguous 32-64 KiB) into a shared-memory ring ``depth`` stages deep with
  nothing done on them: the package's TMA kernels' weight stream with no wgmma and no ``x``.

Blocks past the end are clamped to the last (re-read from the L2). Every variant is checked against
the float64 sum of the weight (the ``tma`` ring keeps no data: it writes nothing) and timed with
CUPTI over weight copies rotated past the L2, beside XLA's row sum. ``both8`` (the 33 MB) runs the
whole sweep; the other sizes (the tp8 gate/up and down apart, both tp1 weights) run the three
fastest variants of each family there (default ``--sizes both8,gate_up8,down8,both1``). The table
prints last; rows go to $OUT/read_floor_probe.json.

Found on an H100 (benchmarks/RESULTS.md, twenty-third session, one run): the TMA ring reads the
33 MB in 11.58 us against XLA's row sum's 12.96 (every TMA variant under 12.0), the fastest
Triton read in 12.42 (slower than XLA's at the other sizes); the two tp8 weights read apart take
8.22 + 4.90 us; at tp1's 264 MB XLA's and the TMA ring lie within 1.1%. On the H200
(twenty-fourth session, two runs): the TMA ring reads the 33 MB in 8.45-8.51 us against XLA's
8.90, the two tp8 weights apart in 6.21-6.24 + 3.87-3.94 us, tp1's 264 MB in 58.05 against 59.12:
9 us leaves 0.55 us past the fastest read for the down's hand-off (1-2 us a global hand-off in
the thirteenth session's one-launch kernel).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

import tma_probes

WIDTH = 1024  # elements of one row of the triton family's flat view (2 KiB)
BOX = 256  # elements of one row of the tma family's flat view: one TMA box row (512 bytes)


def weight_shape(size: str) -> tuple[int, int]:
    """The array ``size`` names, ``<gate_up|down|both><tp>``: one rank's shared-expert gate/up,
    down, or both as one ``[3 S_r, H]`` array, at Kimi-K3's sizes."""
    from shared_expert_timing import Shape
    s = Shape.k3(int(size[-1]))
    return dict(gate_up=(2 * s.shared, s.hidden), down=(s.hidden, s.shared),
                both=(3 * s.shared, s.hidden))[size[:-1]]


def triton_read(w, *, rows, programs, num_warps, num_stages, interpret=False):
    """Float32 sum of every element of ``w`` (any shape, ``size`` a multiple of ``rows * 1024``),
    as ``programs`` partial sums ``[programs, 16]`` (each row repeats its program's sum)."""
    flat = w.reshape(-1, WIDTH)
    blocks = flat.shape[0] // rows
    steps = -(-blocks // programs)

    def kernel(w_ref, out_ref):
        p = pl.program_id(0)

        def step(i, acc):
            block = jnp.minimum(p + i * programs, blocks - 1)
            tile = w_ref[pl.ds(block * rows, rows), :].astype(jnp.float32)
            return acc + jnp.where(p + i * programs < blocks, tile, 0.0)

        acc = lax.fori_loop(0, steps, step, jnp.zeros((rows, WIDTH), jnp.float32))
        total = jnp.sum(jnp.sum(acc, axis=0, keepdims=True), axis=1, keepdims=True)
        out_ref[...] = jnp.broadcast_to(total, (1, 16))

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((programs, 16), jnp.float32), grid=(programs,),
        out_specs=pl.BlockSpec((1, 16), lambda p: (p, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"read_triton_r{rows}_g{programs}",
    )(flat)


def tma_read(w, *, rows, ctas, depth, interpret=False):
    """Copy every ``[rows, 256]`` box of ``w``'s flat view into a shared-memory ring of ``depth``
    stages, CTA ``c`` the boxes ``c, c + ctas, ...``; nothing is computed on them. Returns an
    unwritten ``[8, 128]`` float32 array (the kernel's only output)."""
    flat = w.reshape(-1, BOX)
    boxes = flat.shape[0] // rows
    steps = -(-boxes // ctas)

    def kernel(w_gmem, out_gmem):
        del out_gmem
        cta = lax.axis_index("cta")

        def body(_, w_smem):
            del w_smem

        spec = plgpu.BlockSpec((rows, BOX),
                               lambda s: (jnp.minimum(cta + s * ctas, boxes - 1), 0))
        plgpu.emit_pipeline(body, grid=(steps,), in_specs=[spec],
                            max_concurrent_steps=depth)(w_gmem)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(ctas,),
        grid_names=("cta",), interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"read_tma_r{rows}_g{ctas}_d{depth}",
    )(flat)


def sweep(interpret: bool):
    """(family, label, function of ``w``) for the whole sweep at ``both8``."""
    programs = (132, 264, 528) if not interpret else (3,)
    for rows in (8, 16, 32):
        for g in programs:
            for warps in (4, 8):
                yield "triton", f"r{rows} g{g} w{warps} s3", functools.partial(
                    triton_read, rows=rows, programs=g, num_warps=warps, num_stages=3,
                    interpret=interpret)
    for rows, depths in ((64, (4, 6)), (128, (3,))):
        for g in programs:
            for depth in depths:
                yield "tma", f"r{rows} g{g} d{depth}", functools.partial(
                    tma_read, rows=rows, ctas=g, depth=depth, interpret=interpret)


def drop_x(fn):
    """``fn(w)`` as the probes call a variant: ``(x, w)``, ``x`` unused."""
    return lambda x, w: fn(w)


def main() -> None:
    def extra(parser):
        parser.add_argument("--sizes", default="both8,gate_up8,down8,both1")

    args, device = tma_probes.start(__doc__, "0", extra)
    sizes = args.sizes.split(",")
    if sizes[0] != "both8":
        raise SystemExit(f"--sizes: both8 comes first (it picks the variants), got {args.sizes}")
    x = jnp.zeros((8, 128), jnp.bfloat16)
    rows, picked = [], None
    for size in sizes:
        shape = weight_shape(size) if not args.interpret else (64, 4096)
        if args.interpret:
            copies = [jax.random.normal(jax.random.key(0), shape).astype(jnp.bfloat16)]
        else:
            from shared_expert_timing import random_copies
            nbytes = 2 * shape[0] * shape[1]
            copies = random_copies(shape, shape[1], nbytes, seed=len(rows))
        want = float(np.asarray(copies[0], np.float64).sum())
        scale = float(np.abs(np.asarray(copies[0], np.float64)).sum())
        variants = [("xla", "row sum", tma_probes.xla_row_sum)]
        variants += [(f, label, drop_x(fn)) for f, label, fn in (picked or sweep(args.interpret))]
        size_rows = []
        for family, label, fn in variants:
            row = dict(size=size, mb=2 * shape[0] * shape[1] / 1e6, family=family, variant=label)
            out = tma_probes.run_variant(fn, x, copies, row, args.interpret)
            if out is not None and family != "tma":
                out = out.astype(np.float64)
                got = out[:, 0].sum() if family == "triton" else out.sum()
                row["sum_ok"] = bool(abs(got - want) <= 1e-6 * scale)
            size_rows.append(row)
            print(json.dumps(row), flush=True)
        rows += size_rows
        if args.interpret:  # the bits on one small shape; nothing to pick from
            break
        if picked is None:
            picked = []
            for family in ("triton", "tma"):
                fns = {label: fn for f, label, fn in sweep(False) if f == family}
                timed = sorted((r for r in size_rows if r["family"] == family and "us" in r),
                               key=lambda r: r["us"])
                picked += [(family, r["variant"], fns[r["variant"]]) for r in timed[:3]]
    tma_probes.report(rows, args.out, "read_floor_probe", device.device_kind, "sum ok",
                      title="plain reads of the shared expert's weights", check="sum_ok",
                      label=lambda r: (f"{r['size']:>8} {r['mb']:6.1f} MB {r['family']:>6} "
                                       f"{r['variant']:>16}"))


if __name__ == "__main__":
    main()
