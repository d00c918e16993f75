"""Does one wgmma over a CTA's gate and up rows together, instead of one each, speed up the
``batch_m`` gate/up at large B? (GPU; ``--interpret`` on the CPU.)

  python benchmarks/merged_gate_up_probe.py --out $OUT [--batches 32,64] [--interpret]

With ``batch_m`` (``GemmConfig``) a gate/up CTA multiplies the step's ``[64, block_k]`` stage of
``x`` (wgmma's A) by its gate rows and by its up rows in two wgmmas, each reading ``x`` from shared
memory: per step of 128 columns and 48 rows, 56 KiB read by the wgmmas beside the 40 KiB the TMA
copies write. ``batch_cost_probe.py`` (H100) put 1.7-2.5 us of the tp1 B=64 gate/up on its
wgmmas.
If the weight is stored so that each CTA's gate rows and up rows are neighbours (``interleave``:
``[gate_0; up_0; gate_1; up_1; ...]`` in tiles of ``rows``), one TMA box copies both and one wgmma
of N = 2 ``rows`` reads ``x`` once: 40 KiB read a step instead of 56.

Variants (tp1): the package's ``batch_m`` gate/up at 48 and 64 rows (128 and 96 CTAs; the H100
table's tp1 B=64 ring, bk128 st4), and the merged kernel on the interleaved weight at the same rows
and ring and one stage deeper; each merged output checked bit for bit against the package's at its
rows, then timed with CUPTI over weight copies rotated past the L2, beside XLA's row sum. The table
prints last; rows go to $OUT/merged_gate_up_probe.json.

Found on an H100 (benchmarks/RESULTS.md, twenty-first session, one run): bit-equal, and level with
the package (within -0.5 to +0.3 us at B = 32 and 64, 48 and 64 rows): the wgmmas' reads of ``x``
are not what costs B=64 its time. The package keeps its weight layout and two wgmmas.
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
from moe_front_jax.pallas.streaming import TMA_MAX_BATCH
from tma_probes import BETA, LINEAR_BETA

BLOCK_K = 128


def interleave(gate_up: jax.Array, rows: int) -> jax.Array:
    """``[2 S_r, H]`` (gate rows, then up rows) -> ``[2 S_r, H]`` with tile ``t``'s ``rows`` gate
    rows followed by its ``rows`` up rows at rows ``2 rows t ...``."""
    two_s, h = gate_up.shape
    return gate_up.reshape(2, two_s // 2 // rows, rows, h).transpose(1, 0, 2, 3).reshape(two_s, h)


def merged_gate_up(x, gate_up_tiles, *, rows, depth, interpret=False):
    """``situ(bf16(x @ gate.T), bf16(x @ up.T))`` ``[B, S_r]`` from the interleaved weight: CTA
    ``t`` copies its ``[2 rows, block_k]`` box a step and accumulates ``[64, 2 rows]`` in one
    wgmma (``x``'s rows past B zero filled by the copy)."""
    batch, depth_k = x.shape
    bp, s_r = tma.padded_batch(batch), gate_up_tiles.shape[0] // 2
    transforms = tma._transforms(BLOCK_K)

    def kernel(x_gmem, w_gmem, out_gmem):
        tma._await_inputs(interpret)
        tile = lax.axis_index("tile")

        def scope(acc):
            def body(_, w_smem, x_smem):
                plgpu.wgmma(acc, x_smem, w_smem.T)
                plgpu.wgmma_wait(1)

            plgpu.emit_pipeline(
                body, grid=(depth_k // BLOCK_K,), max_concurrent_steps=depth,
                in_specs=[plgpu.BlockSpec((2 * rows, BLOCK_K), lambda k: (tile, k),
                                          transforms=transforms, delay_release=1),
                          plgpu.BlockSpec((TMA_MAX_BATCH, BLOCK_K), lambda k: (0, k),
                                          transforms=transforms, delay_release=1)],
            )(w_gmem, x_gmem)
            both = acc[...].astype(jnp.bfloat16)
            hidden = reference.situ(both[:, :rows], both[:, rows:], BETA, LINEAR_BETA)
            tma._store_rows(hidden, out_gmem, tile * rows, bp)

        pl.run_scoped(scope, plgpu.ACC((TMA_MAX_BATCH, 2 * rows), jnp.float32))

    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, s_r), jnp.bfloat16), grid=(s_r // rows,),
        grid_names=("tile",), interpret=tma._interpret_params(interpret),
        kernel_name="merged_gate_up_situ",
    )(tma._tma_rows(x), gate_up_tiles)
    return out[:batch]


def main() -> None:
    args, device = tma_probes.start(__doc__, "32,64")
    s_r, hidden, copies = tma_probes.weights(args.interpret)
    depth = 3 if args.interpret else 4
    table_rows = (64,) if args.interpret else (48, 64)
    results = []
    for batch in map(int, args.batches.split(",")):
        x, _, small = tma_probes.operands(batch, s_r, hidden)
        plain = copies["gate_up"] if copies else [small["gate_up"]]
        for rows in table_rows:
            tiled = [jax.jit(interleave, static_argnums=1)(w, rows) for w in plain]
            cases = [(f"package batch_m r{rows} st{depth}",
                      functools.partial(tma_probes.package_gate_up, block_k=BLOCK_K, rows=rows,
                                        depth=depth, batch_m=True), plain)]
            cases += [(f"merged r{rows} st{d}", functools.partial(merged_gate_up, rows=rows,
                                                                   depth=d), tiled)
                      for d in (depth, depth + 1)]
            package = None
            for name, fn, weights in cases:
                if args.interpret:
                    fn = functools.partial(fn, interpret=True)
                row = dict(batch=batch, kernel="gate_up", variant=name)
                out = tma_probes.run_variant(fn, x, weights, row, args.interpret)
                if package is None:
                    package = out
                elif out is not None and package is not None:
                    row["same_bits"] = bool(np.array_equal(out, package))
                results.append(row)
                print(json.dumps(row), flush=True)
        row = dict(batch=batch, kernel="gate_up", variant="xla row sum")
        tma_probes.run_variant(tma_probes.xla_row_sum, x, plain, row, args.interpret)
        results.append(row)
    tma_probes.report(results, args.out, "merged_gate_up_probe", device.device_kind,
                      "bits equal to the package's batch_m at its rows")


if __name__ == "__main__":
    main()
