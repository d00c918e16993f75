"""Does a warp-specialized TMA pipeline, or ``x`` multicast across a cluster of 2 CTAs, read the
shared expert's weights faster than the package's TMA kernels? (GPU; ``--interpret`` on the CPU.)

  python benchmarks/warp_specialized_probe.py --out $OUT [--batches 1,32,64] [--interpret]

The package's TMA kernels (``pallas/shared_expert_tma.py``) run one warpgroup per CTA that both
issues the TMA copies of ``emit_pipeline``'s ring and the wgmmas. At tp1 they read the weights at
3.8-4.1 TB/s where XLA's row sum of the same weight reads 4.5 (twelfth session), and B=64 is
2-3 us slower per call than B=1. This probe builds the same two GEMMs (same tiles, same
arithmetic, same epilogues) on ``plgpu.emit_pipeline_warp_specialized``: a memory warpgroup that
only issues the copies and one compute warpgroup that only issues wgmmas. With ``cluster=2`` two
neighbouring CTAs (two row tiles) share each stage of ``x`` (or ``hidden``): one TMA multicast
instead of two copies from L2, which halves that traffic (88 MB per call at B=64, beside the
264 MB of weights).

Every variant's output is compared bit for bit with the package's kernel (same K order per tile,
so the bits must agree); then both are timed with CUPTI over weight copies rotated past L2. The
table prints last; rows go to $OUT/warp_specialized_probe.json.
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


def _ws_kernel(x, w, n_out, epilogue, *, block_k, depth, cluster, name, interpret=False):
    """``out[:, 64 t : 64 t + 64] = epilogue(*accs)`` for row tile ``t`` of ``n_out // 64``, where
    ``accs[p]`` is the float32 ``[64, Bp]`` product of ``x`` with the weight rows
    ``p * n_out + 64 t ...`` (gate/up: ``p`` = 0, 1; down: ``p`` = 0)."""
    batch, depth_k = x.shape
    bp, tiles = tma.padded_batch(batch), n_out // ROWS
    parts = w.shape[0] // n_out
    steps = depth_k // block_k
    transforms = tma._transforms(block_k)
    if tiles % cluster:
        raise ValueError(f"{tiles} row tiles do not split into clusters of {cluster}")

    def kernel(x_gmem, w_gmem, out_gmem, out_smem):
        tile = lax.axis_index("tile")
        if cluster > 1:
            tile = tile * cluster + lax.axis_index("cluster")
        w_tiles = [w_gmem.at[pl.ds((p * tiles + tile) * ROWS, ROWS)] for p in range(parts)]

        def body(_, *smem_and_carry):
            *w_smem, x_smem, accs = smem_and_carry
            for acc, w_stage in zip(accs, w_smem):
                plgpu.wgmma(acc, w_stage, x_smem.T)
            plgpu.wgmma_wait(parts)  # this step's wgmmas may run; the last step's are done
            return accs

        def compute(eval_pipeline):
            def scope(*accs):
                eval_pipeline(accs)
                out_smem.T[...] = epilogue(*(acc[...] for acc in accs))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(0, bp), pl.ds(tile * ROWS, ROWS)])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(scope, *[plgpu.ACC((ROWS, bp), jnp.float32)] * parts)

        w_spec = plgpu.BlockSpec((ROWS, block_k), lambda k: (0, k), transforms=transforms,
                                 delay_release=1)
        x_spec = plgpu.BlockSpec((bp, block_k), lambda k: (0, k), transforms=transforms,
                                 delay_release=1,
                                 collective_axes=("cluster",) if cluster > 1 else None)
        plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40, in_specs=[*[w_spec] * parts, x_spec],
            max_concurrent_steps=depth, wg_axis="wg", num_compute_wgs=1, compute_context=compute,
        )(*w_tiles, x_gmem)

    kwargs = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, n_out), jnp.bfloat16),
        grid=(tiles // cluster,), grid_names=("tile",), num_threads=2, thread_name="wg",
        scratch_types=[plgpu.SMEM((bp, ROWS), jnp.bfloat16)],
        interpret=tma._interpret_params(interpret), kernel_name=name, **kwargs,
    )(x, w)


def ws_gate_up(x, gate_up, **kw):
    def situ(gate, up):
        return reference.situ(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), BETA,
                              LINEAR_BETA)

    return _ws_kernel(tma._tma_rows(x), gate_up, gate_up.shape[0] // 2, situ,
                      name="ws_gate_up_situ", **kw)[: x.shape[0]]


def ws_down(hidden, down, **kw):
    return _ws_kernel(tma._tma_rows(hidden), down, down.shape[0],
                      lambda acc: acc.astype(jnp.bfloat16), name="ws_down", **kw)[: hidden.shape[0]]


def variants(kernel: str):
    """(label, function, kwargs): the package's best H200 schedules (tp1 table) and the probe's
    forms of them."""
    package = tma_probes.package_gate_up if kernel == "gate_up" else tma_probes.package_down
    probe = ws_gate_up if kernel == "gate_up" else ws_down
    depths = (4, 5) if kernel == "gate_up" else (5, 6)
    yield "package", package, dict(block_k=128, depth=depths[0])
    for depth in depths:
        for cluster in (1, 2):
            yield "ws+mc" if cluster > 1 else "ws", probe, dict(block_k=128, depth=depth,
                                                                 cluster=cluster)


def main() -> None:
    args, device = tma_probes.start(__doc__, "1,32,64")
    s_r, hidden, copies = tma_probes.weights(args.interpret)
    rows = []
    for batch in map(int, args.batches.split(",")):
        x, h, small = tma_probes.operands(batch, s_r, hidden)
        for kernel, operand in (("gate_up", x), ("down", h)):
            weights = copies[kernel] if copies else [small[kernel]]
            first = None
            for name, fn, kw in variants(kernel):
                if args.interpret:  # a small K: 8 steps of 64 columns through 3 stages
                    kw = dict(kw, block_k=64, depth=3, interpret=True)
                label = f"{name} bk{kw['block_k']} st{kw['depth']}"
                row = dict(batch=batch, kernel=kernel, variant=label)
                out = tma_probes.run_variant(functools.partial(fn, **kw), operand, weights, row,
                                             args.interpret)
                if out is not None:
                    first = out if first is None else first
                    row["same_bits"] = bool(np.array_equal(out, first))
                rows.append(row)
                print(json.dumps(row), flush=True)
    tma_probes.report(rows, args.out, "warp_specialized_probe", device.device_kind,
                      "same bits as the package")


if __name__ == "__main__":
    main()
