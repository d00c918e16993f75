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

ROWS = 64
BETA, LINEAR_BETA = 4.0, 25.0


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


def package_gate_up(x, gate_up, *, block_k, depth, interpret=False):
    config = GemmConfig(ROWS, block_k, 1, 4, depth, tma=True)
    return tma.gate_up_situ(x, gate_up, BETA, LINEAR_BETA, config=config, interpret=interpret)


def package_down(hidden, down, *, block_k, depth, interpret=False):
    config = GemmConfig(ROWS, block_k, 1, 4, depth, tma=True)
    return tma.down_proj(hidden, down, config=config, interpret=interpret)


def variants(kernel: str):
    """(label, function, kwargs): the package's best H200 schedules (tp1 table) and the probe's
    forms of them."""
    package = package_gate_up if kernel == "gate_up" else package_down
    probe = ws_gate_up if kernel == "gate_up" else ws_down
    depths = (4, 5) if kernel == "gate_up" else (5, 6)
    yield "package", package, dict(block_k=128, depth=depths[0])
    for depth in depths:
        for cluster in (1, 2):
            yield "ws+mc" if cluster > 1 else "ws", probe, dict(block_k=128, depth=depth,
                                                                 cluster=cluster)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="1,32,64")
    parser.add_argument("--interpret", action="store_true",
                        help="check the bits on a small shape in interpret mode, no timing")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    if args.interpret:
        s_r, hidden, copies = 256, 512, None
    else:
        from shared_expert_timing import Shape, down_copies, gate_up_copies
        shape = Shape.k3(1)
        s_r, hidden = shape.shared, shape.hidden
        copies = dict(gate_up=gate_up_copies(shape), down=down_copies(shape))
    rows = []
    for batch in map(int, args.batches.split(",")):
        keys = jax.random.split(jax.random.key(batch), 4)
        x = jax.random.normal(keys[0], (batch, hidden), jnp.float32).astype(jnp.bfloat16)
        h = jax.random.normal(keys[1], (batch, s_r), jnp.float32).astype(jnp.bfloat16)
        small = dict(
            gate_up=(jax.random.normal(keys[2], (2 * s_r, hidden)) / 20).astype(jnp.bfloat16),
            down=(jax.random.normal(keys[3], (hidden, s_r)) / 20).astype(jnp.bfloat16))
        for kernel, operand in (("gate_up", x), ("down", h)):
            weights = copies[kernel] if copies else [small[kernel]]
            first = None
            for name, fn, kw in variants(kernel):
                if args.interpret:  # a small K: 8 steps of 64 columns through 3 stages
                    kw = dict(kw, block_k=64, depth=3, interpret=True)
                fn_ = functools.partial(fn, **kw)
                label = f"{name} bk{kw['block_k']} st{kw['depth']}"
                row = dict(batch=batch, kernel=kernel, variant=label)
                try:
                    compiled = jax.jit(fn_).lower(operand, weights[0]).compile()
                    out = np.asarray(compiled(operand, weights[0]).astype(jnp.float32))
                    first = out if first is None else first
                    row["same_bits"] = bool(np.array_equal(out, first))
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
    with open(os.path.join(args.out, "warp_specialized_probe.json"), "w") as f:
        json.dump(dict(device=device.device_kind, rows=rows), f, indent=1)
    print(f"\nshared expert at tp1 ({device.device_kind}): us per call, TB/s of weight read")
    for r in rows:
        result = (f"{r['us']:6.2f} us {r['tbs']:.2f} TB/s" if "us" in r else
                  r.get("error", "")[:60] or "(not timed)")
        print(f"B={r['batch']:>2} {r['kernel']:>7} {r['variant']:>18}: {result}  "
              f"same bits as the package: {r.get('same_bits')}")


if __name__ == "__main__":
    main()
