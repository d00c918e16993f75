"""Does a tile-major weight layout, where each TMA copy reads one contiguous 8 KiB block, lift the
TMA kernels' weight read towards XLA's row sum? (GPU; ``--interpret`` on the CPU.)

  python benchmarks/tiled_weight_probe.py --out $OUT [--batches 1,64] [--interpret]

The package's TMA kernels (``pallas/shared_expert_tma.py``) copy a ``[64, block_k]`` box of the
row-major ``[R, K]`` weight per stage. With the 128-byte swizzle wgmma reads, Mosaic GPU moves a
box as 64-column copies: 64 segments of 128 bytes, ``2 K`` bytes apart (14 KiB at K = 7168). At
tp1 those kernels read 3.9-4.2 TB/s, where XLA's row sum of the same weight reads 4.5 (twelfth
session), and Nsight Compute put the gate/up at 81-84% of the DRAM peak. This probe stores the
weight tile-major: ``tiled[(t K/64 + j) 64 + r, c] = w[64 t + r, 64 j + c]`` (``tile_major``), so a
stage of ``64 n`` columns is ``n`` consecutive, contiguous ``[64, 64]`` blocks (the copy of
``[64 n, 64]`` rows of the ``[R K / 64, 64]`` array), and it multiplies them by ``n`` ``[Bp, 64]``
copies of ``x`` in ``n`` wgmmas: the same products in the same K order as the package's kernel at
the same stage width, so the output bits must agree with it.

Variants per kernel and batch (tp1): the package at its H200 table's schedule (bk128) and at bk64,
and the tile-major kernel at stages of 64, 128 and 256 columns; each checked bit for bit against
the package's at its stage width (none at 256), then timed with CUPTI over weight copies rotated
past the L2, beside XLA's dot and XLA's row sum of the same weight (the read ceiling). The table
prints last; rows go to $OUT/tiled_weight_probe.json.

Found on an H100 (benchmarks/RESULTS.md, nineteenth session, three runs): bit-equal, and no faster
where it counts: the down 0.3-0.8 us faster, the gate/up up to 2.3 us slower in five of six pairs,
so the package keeps the row-major weight. Not yet run on an H200. (``--interpret`` checks the
layout on a small shape: there a wgmma is one dot of its whole stage, so only the bk64 variants'
bits must agree; on the GPU every width's did.)
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

PANEL = 64


def tile_major(w: jax.Array) -> jax.Array:
    """``[R, K]`` -> ``[R K / 64, 64]``: the ``[64, 64]`` blocks of ``w``, row tile by row tile,
    each tile's blocks in K order, each block row-major (so contiguous: 8 KiB in bfloat16)."""
    r, k = w.shape
    blocks = w.reshape(r // ROWS, ROWS, k // PANEL, PANEL).transpose(0, 2, 1, 3)
    return blocks.reshape(r * k // PANEL, PANEL)


def _tiled_kernel(x, w_tiled, n_out, epilogue, *, panels, depth, name, interpret=False):
    """``out[:, 64 t : 64 t + 64] = epilogue(*accs)`` for row tile ``t`` of ``n_out // 64``, where
    ``accs[p]`` is the float32 ``[64, Bp]`` product of ``x`` with the weight rows
    ``p * n_out + 64 t ...`` of the tile-major ``w_tiled``; a stage is ``panels`` blocks."""
    batch, depth_k = x.shape
    bp, tiles = tma.padded_batch(batch), n_out // ROWS
    parts = w_tiled.shape[0] * PANEL // depth_k // n_out
    steps = depth_k // (PANEL * panels)
    transforms = tma._transforms(PANEL)

    def kernel(x_gmem, w_gmem, out_gmem):
        tile = lax.axis_index("tile")

        def scope(*accs):
            def body(_, *smem):
                w_smem, x_smem = smem[:parts], smem[parts:]
                for acc, w in zip(accs, w_smem):
                    for j, x_j in enumerate(x_smem):
                        plgpu.wgmma(acc, w.at[pl.ds(j * ROWS, ROWS)], x_j.T)
                plgpu.wgmma_wait(parts * panels)

            w_specs = [
                plgpu.BlockSpec((ROWS * panels, PANEL),
                                lambda k, t=tile + p * tiles: (t * steps + k, 0),
                                transforms=transforms, delay_release=1)
                for p in range(parts)
            ]
            x_specs = [
                plgpu.BlockSpec((bp, PANEL), lambda k, j=j: (0, k * panels + j),
                                transforms=transforms, delay_release=1)
                for j in range(panels)
            ]
            plgpu.emit_pipeline(body, grid=(steps,), in_specs=[*w_specs, *x_specs],
                                max_concurrent_steps=depth)(*[w_gmem] * parts,
                                                            *[x_gmem] * panels)
            tma._store_transposed(epilogue(*(acc[...] for acc in accs)), out_gmem, tile * ROWS)

        pl.run_scoped(scope, *[plgpu.ACC((ROWS, bp), jnp.float32)] * parts)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, n_out), jnp.bfloat16), grid=(tiles,),
        grid_names=("tile",), interpret=tma._interpret_params(interpret), kernel_name=name,
    )(x, w_tiled)


def _situ(gate, up):
    return reference.situ(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), BETA, LINEAR_BETA)


def tiled_gate_up(x, gate_up_tiled, *, panels, depth, interpret=False):
    n_out = gate_up_tiled.shape[0] * PANEL // x.shape[1] // 2
    return _tiled_kernel(tma._tma_rows(x), gate_up_tiled, n_out, _situ, panels=panels,
                         depth=depth, name="tiled_gate_up_situ", interpret=interpret)[: x.shape[0]]


def tiled_down(hidden, down_tiled, *, panels, depth, interpret=False):
    n_out = down_tiled.shape[0] * PANEL // hidden.shape[1]
    return _tiled_kernel(tma._tma_rows(hidden), down_tiled, n_out,
                         lambda acc: acc.astype(jnp.bfloat16), panels=panels, depth=depth,
                         name="tiled_down", interpret=interpret)[: hidden.shape[0]]


def xla_dot(x, w):
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def variants(kernel: str):
    """(label, function, kwargs, layout): the package's tp1 H200 table schedule (bk128; gate/up st4,
    down st6), the package at bk64, the tile-major kernel at 1, 2 and 4 blocks a stage, and XLA."""
    gate_up = kernel == "gate_up"
    package = tma_probes.package_gate_up if gate_up else tma_probes.package_down
    tiled = tiled_gate_up if gate_up else tiled_down
    d128 = 4 if gate_up else 6
    yield "package bk128", package, dict(block_k=128, depth=d128), "rows"
    yield "package bk64", package, dict(block_k=64, depth=2 * d128), "rows"
    yield "tiled bk64", tiled, dict(panels=1, depth=2 * d128), "tiled"
    yield "tiled bk128", tiled, dict(panels=2, depth=d128), "tiled"
    yield "tiled bk128 +1", tiled, dict(panels=2, depth=d128 + 1), "tiled"
    yield "tiled bk256", tiled, dict(panels=4, depth=max(2, d128 // 2)), "tiled"
    yield "xla dot", xla_dot, {}, "rows"
    yield "xla row sum", tma_probes.xla_row_sum, {}, "rows"


def main() -> None:
    args, device = tma_probes.start(__doc__, "1,64")
    s_r, hidden, copies = tma_probes.weights(args.interpret)
    tile = jax.jit(tile_major)
    rows = []
    for batch in map(int, args.batches.split(",")):
        x, h, small = tma_probes.operands(batch, s_r, hidden)
        for kernel, operand in (("gate_up", x), ("down", h)):
            layouts = dict(rows=copies[kernel] if copies else [small[kernel]])
            layouts["tiled"] = [tile(w) for w in layouts["rows"]]
            package = {}  # block_k -> the package's output at it
            for name, fn, kw, layout in variants(kernel):
                if args.interpret and not name.startswith("xla"):
                    if "bk256" in name:
                        continue
                    kw = dict(kw, depth=3, interpret=True)
                row = dict(batch=batch, kernel=kernel, variant=name, **{
                    k: v for k, v in kw.items() if k != "interpret"})
                out = tma_probes.run_variant(functools.partial(fn, **kw), operand,
                                             layouts[layout], row, args.interpret)
                block_k = kw.get("block_k") or PANEL * kw.get("panels", 0)
                if out is not None and name.startswith("package"):
                    package[block_k] = out
                if out is not None and block_k in package:
                    row["same_bits"] = bool(np.array_equal(out, package[block_k]))
                rows.append(row)
                print(json.dumps(row), flush=True)
    tma_probes.report(rows, args.out, "tiled_weight_probe", device.device_kind,
                      "same bits as the package at its block_k")


if __name__ == "__main__":
    main()
