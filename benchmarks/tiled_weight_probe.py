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
so the package keeps the row-major weight. Not yet run on an H200.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_front_jax import reference
from moe_front_jax.pallas import shared_expert_tma as tma
from moe_front_jax.pallas.streaming import GemmConfig

ROWS = PANEL = 64
BETA, LINEAR_BETA = 4.0, 25.0


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


def package_gate_up(x, gate_up, *, block_k, depth, interpret=False):
    config = GemmConfig(ROWS, block_k, 1, 4, depth, tma=True)
    return tma.gate_up_situ(x, gate_up, BETA, LINEAR_BETA, config=config, interpret=interpret)


def package_down(hidden, down, *, block_k, depth, interpret=False):
    config = GemmConfig(ROWS, block_k, 1, 4, depth, tma=True)
    return tma.down_proj(hidden, down, config=config, interpret=interpret)


def xla_dot(x, w):
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def xla_row_sum(x, w):
    """The read ceiling: XLA's row sum of the weight (``x`` unused)."""
    del x
    return w.astype(jnp.float32).sum(axis=1)


def variants(kernel: str):
    """(label, function, kwargs, layout): the package's tp1 H200 table schedule (bk128; gate/up st4,
    down st6), the package at bk64, the tile-major kernel at 1, 2 and 4 blocks a stage, and XLA."""
    gate_up = kernel == "gate_up"
    package = package_gate_up if gate_up else package_down
    tiled = tiled_gate_up if gate_up else tiled_down
    d128 = 4 if gate_up else 6
    yield "package bk128", package, dict(block_k=128, depth=d128), "rows"
    yield "package bk64", package, dict(block_k=64, depth=2 * d128), "rows"
    yield "tiled bk64", tiled, dict(panels=1, depth=2 * d128), "tiled"
    yield "tiled bk128", tiled, dict(panels=2, depth=d128), "tiled"
    yield "tiled bk128 +1", tiled, dict(panels=2, depth=d128 + 1), "tiled"
    yield "tiled bk256", tiled, dict(panels=4, depth=max(2, d128 // 2)), "tiled"
    yield "xla dot", xla_dot, {}, "rows"
    yield "xla row sum", xla_row_sum, {}, "rows"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--interpret", action="store_true",
                        help="check the bits on a small shape in interpret mode, no timing")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    if args.interpret:
        s_r, hidden, copies = 128, 512, None
    else:
        from shared_expert_timing import Shape, down_copies, gate_up_copies
        shape = Shape.k3(1)
        s_r, hidden = shape.shared, shape.hidden
        copies = dict(gate_up=gate_up_copies(shape), down=down_copies(shape))
    tile = jax.jit(tile_major)
    rows = []
    for batch in map(int, args.batches.split(",")):
        keys = jax.random.split(jax.random.key(batch), 4)
        x = jax.random.normal(keys[0], (batch, hidden), jnp.float32).astype(jnp.bfloat16)
        h = jax.random.normal(keys[1], (batch, s_r), jnp.float32).astype(jnp.bfloat16)
        small = dict(
            gate_up=(jax.random.normal(keys[2], (2 * s_r, hidden)) / 20).astype(jnp.bfloat16),
            down=(jax.random.normal(keys[3], (hidden, s_r)) / 20).astype(jnp.bfloat16))
        for kernel, operand in (("gate_up", x), ("down", h)):
            layouts = dict(rows=copies[kernel] if copies else [small[kernel]])
            layouts["tiled"] = [tile(w) for w in layouts["rows"]]
            package = {}  # block_k -> the package's output at it
            for name, fn, kw, layout in variants(kernel):
                if args.interpret and not name.startswith("xla"):
                    if "bk256" in name:
                        continue
                    kw = dict(kw, depth=3, interpret=True)
                weights = layouts[layout]
                row = dict(batch=batch, kernel=kernel, variant=name, **{
                    k: v for k, v in kw.items() if k != "interpret"})
                try:
                    compiled = jax.jit(functools.partial(fn, **kw)).lower(
                        operand, weights[0]).compile()
                    out = np.asarray(compiled(operand, weights[0]).astype(jnp.float32))
                    block_k = kw.get("block_k") or PANEL * kw.get("panels", 0)
                    if name.startswith("package"):
                        package[block_k] = out
                    if block_k in package:
                        row["same_bits"] = bool(np.array_equal(out, package[block_k]))
                    if not args.interpret:
                        from front_gemm_timing import cupti_us_per_call
                        row["us"], row["kernels"] = cupti_us_per_call(compiled, operand, weights,
                                                                       rounds=5)
                        row["tbs"] = weights[0].nbytes / row["us"] / 1e6
                except Exception as e:  # noqa: BLE001 -- a variant that fails is a row of the table
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tiled_weight_probe.json"), "w") as f:
        json.dump(dict(device=device.device_kind, rows=rows), f, indent=1)
    print(f"\nshared expert at tp1 ({device.device_kind}): us per kernel, TB/s of weight read")
    for r in rows:
        result = (f"{r['us']:6.2f} us {r['tbs']:.2f} TB/s" if "us" in r else
                  r.get("error", "")[:60] or "(not timed)")
        print(f"B={r['batch']:>2} {r['kernel']:>7} {r['variant']:>15}: {result}  "
              f"same bits as the package at its block_k: {r.get('same_bits', '-')}")


if __name__ == "__main__":
    main()
