"""Where does B=64 lose its time in the shared expert's TMA kernels: the copies of ``x``, or the
wgmmas? (GPU; ``--interpret`` on the CPU.)

  python benchmarks/batch_cost_probe.py --out $OUT [--batches 64] [--interpret]

At tp1 the package's TMA gate/up (``pallas/shared_expert_tma.py``, 64 weight rows a CTA, the batch
as wgmma's N) takes 41.6-42.2 us on the H200 at B <= 8 and 44.4 at B=64; the down 21.3-21.6 and
22.9 (twelfth session); on the H100 the gate/up at B=64 is 4.9-7.1 us behind XLA's row sum of the
same weight and 0.6-3.7 at B=1 (nineteenth session). Per K step of 128 columns a B=64 CTA copies a
16 KiB stage of ``x`` beside its 32 KiB of weight, and its wgmmas read 64 KiB of shared memory
instead of 36; which of the two holds the weight stream back decides what to build next.

This probe runs the package's kernel at B and at B=8, and a copy of it whose ring copies
``x_rows`` rows of ``x`` a stage (0: none) and whose wgmmas multiply only ``mma_rows`` of them
(0: none), on the same weights and the same ring (block_k 128; gate/up 4 stages, down 6, the
H200 table's tp1 B=64 rings), beside XLA's row sum (the read ceiling). Only the copy at
``x_rows = mma_rows = B`` computes the product: its bits must equal the package's (or, with the
CTAs' K steps rotated, lie close to them); the others are timing ablations whose outputs mean
nothing. Each is timed with CUPTI over weight copies rotated past the L2. The table prints last;
rows go to $OUT/batch_cost_probe.json.

Found on an H100 (benchmarks/RESULTS.md, twenty-first session, five runs): the ring alone, no
``x`` copied and no wgmma, reads at XLA's row sum (gate/up 57.1-57.6 us against 56.1-57.3). At
B=64 copying ``x``'s 64 rows instead of 8 costs the gate/up 0.9-2.0 us and the down 0.7-1.3, the
wgmmas over 64 rows instead of 8 another 1.7-2.5 and 0.6-1.0. Three changes aimed at those shares
gain nothing: the CTAs' K steps rotated (slower by up to 1.3 us on the gate/up), ``x`` copied before
the weight (within the runs' spread), and each step waiting for its own wgmmas (3 us slower with
the same ring, level with one stage fewer). Not yet run on an H200.
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

import tma_probes
from moe_front_jax import reference
from moe_front_jax.pallas import shared_expert_tma as tma
from tma_probes import BETA, LINEAR_BETA, ROWS

BLOCK_K = 128
DEPTH = dict(gate_up=4, down=6)


def ablation(x, w, *, parts, x_rows, mma_rows, depth, rotate=0, x_first=False, in_flight=1,
             interpret=False):
    """The package's kernel (``parts`` = 2: gate/up with situ; 1: down) with a ring that copies the
    first ``x_rows`` rows of ``x`` a stage (0: no copy of ``x``) and wgmmas over the first
    ``mma_rows`` of them (0: none, and the output is left unwritten). With ``rotate``, CTA ``t``
    starts at step ``rotate * t`` (mod the steps) and wraps round, so that the CTAs do not all
    read the same stage of ``x`` at once (the float32 sums then run in another order). With
    ``x_first`` each step's copy of ``x`` is issued before the weight's, not after. With
    ``in_flight=0`` a step waits for its own wgmmas, so that its stage is refilled one step
    sooner (the package lets one step's wgmmas run on: ``WGMMA_STEPS_IN_FLIGHT``). Output
    ``[max(mma_rows, 8), R / parts]`` bfloat16; the product only where ``x_rows = mma_rows`` =
    B."""
    if mma_rows > x_rows:
        raise ValueError(f"mma_rows={mma_rows} needs as many rows copied, got x_rows={x_rows}")
    n_out = w.shape[0] // parts
    tiles, steps, out_rows = n_out // ROWS, x.shape[1] // BLOCK_K, max(mma_rows, 8)
    transforms = tma._transforms(BLOCK_K)

    def kernel(x_gmem, w_gmem, out_gmem):
        tma._await_inputs(interpret)
        tile = lax.axis_index("tile")

        def scope(*accs):
            def body(_, *smem):
                if x_first:
                    smem = (*smem[bool(x_rows):], *smem[:bool(x_rows)])
                w_smem, x_smem = smem[:parts], smem[parts:]
                if mma_rows:
                    for acc, w_stage in zip(accs, w_smem):
                        plgpu.wgmma(acc, w_stage, x_smem[0].at[pl.ds(0, mma_rows)].T)
                    plgpu.wgmma_wait(parts * in_flight)

            def step(k):
                return lax.rem(k + rotate * tile, steps) if rotate else k

            specs = [plgpu.BlockSpec((ROWS, BLOCK_K), lambda k, t=tile + p * tiles: (t, step(k)),
                                     transforms=transforms, delay_release=in_flight)
                     for p in range(parts)]
            x_specs = [plgpu.BlockSpec((x_rows, BLOCK_K), lambda k: (0, step(k)),
                                       transforms=transforms, delay_release=in_flight)
                       ] * bool(x_rows)
            gmem = [w_gmem] * parts
            specs, gmem = ((x_specs + specs, [x_gmem] * bool(x_rows) + gmem) if x_first else
                           (specs + x_specs, gmem + [x_gmem] * bool(x_rows)))
            plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs,
                                max_concurrent_steps=depth)(*gmem)
            if mma_rows:  # else nothing to store (a zero tile has no layout a store takes)
                vals = [acc[...] for acc in accs]
                out = (reference.situ(*(v.astype(jnp.bfloat16) for v in vals), BETA, LINEAR_BETA)
                       if parts == 2 else vals[0].astype(jnp.bfloat16))
                tma._store_transposed(out, out_gmem, tile * ROWS)

        pl.run_scoped(scope, *[plgpu.ACC((ROWS, out_rows), jnp.float32)] * parts)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((out_rows, n_out), jnp.bfloat16), grid=(tiles,),
        grid_names=("tile",), interpret=tma._interpret_params(interpret),
        kernel_name=f"ablation_x{x_rows}_mma{mma_rows}",
    )(x, w)


def variants(kernel: str, batch: int, interpret: bool):
    """(label, function of (operand, weight), whether it computes the product)."""
    package = functools.partial(
        tma_probes.package_gate_up if kernel == "gate_up" else tma_probes.package_down,
        block_k=BLOCK_K, depth=DEPTH[kernel], interpret=interpret)
    parts = 2 if kernel == "gate_up" else 1
    yield f"package B={batch}", package, True
    yield "package B=8", lambda a, w: package(a[:8], w), False
    cases = [(batch, batch), (batch, 32), (batch, 8), (batch, 0), (8, 8), (8, 0), (0, 0)]
    for x_rows, mma_rows in dict.fromkeys(c for c in cases if c[1] <= batch):
        yield (f"copy x{x_rows} mma{mma_rows}",
               functools.partial(ablation, parts=parts, x_rows=x_rows, mma_rows=mma_rows,
                                 depth=DEPTH[kernel], interpret=interpret),
               x_rows == mma_rows == batch)
    for x_rows, mma_rows, rotate in ((batch, batch, 1), (batch, batch, 7), (batch, 0, 1)):
        yield (f"copy x{x_rows} mma{mma_rows} rot{rotate}",
               functools.partial(ablation, parts=parts, x_rows=x_rows, mma_rows=mma_rows,
                                 depth=DEPTH[kernel], rotate=rotate, interpret=interpret),
               mma_rows == batch)
    for x_rows, mma_rows in ((batch, batch), (batch, 0)):
        yield (f"copy x{x_rows} first mma{mma_rows}",
               functools.partial(ablation, parts=parts, x_rows=x_rows, mma_rows=mma_rows,
                                 depth=DEPTH[kernel], x_first=True, interpret=interpret),
               mma_rows == batch)
    for depth in (DEPTH[kernel], DEPTH[kernel] - 1):
        yield (f"copy x{batch} mma{batch} st{depth} wait",
               functools.partial(ablation, parts=parts, x_rows=batch, mma_rows=batch,
                                 depth=depth, in_flight=0, interpret=interpret), True)
    yield "xla row sum", tma_probes.xla_row_sum, False


def main() -> None:
    args, device = tma_probes.start(__doc__, "64")
    s_r, hidden, copies = tma_probes.weights(args.interpret)
    rows = []
    for batch in map(int, args.batches.split(",")):
        if batch % 8:
            raise SystemExit(f"--batches: multiples of 8 only (the ablation's copies), got {batch}")
        x, h, small = tma_probes.operands(batch, s_r, hidden)
        for kernel, operand in (("gate_up", x), ("down", h)):
            weights = copies[kernel] if copies else [small[kernel]]
            reference_out = None
            for name, fn, product in variants(kernel, batch, args.interpret):
                row = dict(batch=batch, kernel=kernel, variant=name)
                out = tma_probes.run_variant(fn, operand, weights, row, args.interpret)
                if name == f"package B={batch}":
                    reference_out = out
                elif product and out is not None and reference_out is not None:
                    row["same_bits"] = same = bool(np.array_equal(out, reference_out))
                    if not same:  # the rotated sums: how far from the package's
                        diff = np.abs(out - reference_out).max() / np.abs(reference_out).max()
                        row["same_bits"] = f"no, max diff {diff:.1e} of max |package|"
                rows.append(row)
                print(json.dumps(row), flush=True)
    tma_probes.report(rows, args.out, "batch_cost_probe", device.device_kind,
                      "the product, bits equal to the package's")


if __name__ == "__main__":
    main()
