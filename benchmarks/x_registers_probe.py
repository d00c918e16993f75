"""Does loading ``x`` straight into wgmma's registers, instead of copying it into shared memory
with the weight, speed up the shared expert's TMA kernels at large B? (GPU; ``--interpret`` on the
CPU.)

  python benchmarks/x_registers_probe.py --out $OUT [--batches 64] [--interpret]

``batch_cost_probe.py`` (H100, twenty-first session) split the B=64 loss of the package's tp1
gate/up: copying ``x``'s 64 rows a stage instead of 8 cost 0.9-2.0 us, the wgmmas over 64 rows
instead of 8 another 1.7-2.5. With ``batch_m`` (``GemmConfig``) ``x`` is wgmma's A operand, which
may sit in registers: each thread loads its fragment of the step's ``[64, block_k]`` from global
memory (L2: ``x`` is 0.9 MB that every CTA reads), ``prefetch`` steps ahead through
``emit_pipeline``'s carry, and only the weight goes through the TMA ring and shared memory.

Variants per kernel (tp1, B=64, the weight's CTAs of ``rows`` rows as wgmma's N): the package's
``batch_m`` kernel (``x`` in the ring) at the H100 table's tp1 B=64 schedule (gate/up 48 rows
bk128 st4, down 56 rows bk128 st6), and the register kernel at the same rows and rings with
``x`` loaded 1, 2 and 3 steps ahead, also at 64 rows; each checked bit for bit against the
package's ``batch_m`` kernel at the same rows (same products in the same K order), then timed with
CUPTI over weight copies rotated past the L2, beside XLA's row sum. The table prints last; rows go
to $OUT/x_registers_probe.json. (The Mosaic GPU interpreter of jax 0.11.2 takes wgmma's A from
shared memory only: ``--interpret`` runs the package's kernels and shows that error for the
others.)

Found on an H100 (benchmarks/RESULTS.md, twenty-first session, one run): bit-equal to the
package's ``batch_m`` kernels, and far slower: the gate/up 94.7-100.8 us against 59.7-61.8, the
down 66.5-71.2 against 31.6-32.0, whatever the prefetch distance, so the loads' latency is paid at
every step. The package keeps ``x`` in the ring.
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


def registers_kernel(x, w, *, parts, rows, depth, prefetch, interpret=False):
    """``out[:, rows t : rows (t + 1)] = epilogue(*accs)`` ``[64, R / parts]`` for CTA ``t``,
    ``accs[p]`` the float32 ``[64, rows]`` product of ``x`` ``[64, K]`` with weight rows
    ``p R / parts + rows t ...``; ``x``'s step ``k`` is loaded into registers at step
    ``k - prefetch`` and is wgmma's A, the weight stage (TMA ring) its B. Epilogue: situ of the
    two parts (gate/up) or bfloat16 (down)."""
    batch, depth_k = x.shape
    if batch != TMA_MAX_BATCH:
        raise ValueError(f"x: {TMA_MAX_BATCH} rows (wgmma's M), got {batch}")
    n_out = w.shape[0] // parts
    tiles, steps = n_out // rows, depth_k // BLOCK_K
    transforms = tma._transforms(BLOCK_K)

    def kernel(x_gmem, w_gmem, out_gmem):
        tma._await_inputs(interpret)
        tile = lax.axis_index("tile")

        def x_step(k):
            return plgpu.load(x_gmem.at[:, pl.ds(k * BLOCK_K, BLOCK_K)],
                              layout=plgpu.Layout.WGMMA, optimized=False)

        def scope(*accs):
            def body(idx, *smem_and_carry):
                *w_smem, ahead = smem_and_carry
                (k,) = idx
                for acc, w_stage in zip(accs, w_smem):
                    plgpu.wgmma(acc, ahead[0], w_stage.T)
                plgpu.wgmma_wait(parts)
                return (*ahead[1:], x_step(lax.min(k + prefetch, steps - 1)))

            specs = [plgpu.BlockSpec((rows, BLOCK_K), lambda k, t=tile + p * tiles: (t, k),
                                     transforms=transforms, delay_release=1)
                     for p in range(parts)]
            plgpu.emit_pipeline(
                body, grid=(steps,), in_specs=specs, max_concurrent_steps=depth,
                init_carry=tuple(x_step(min(k, steps - 1)) for k in range(prefetch)),
            )(*[w_gmem] * parts)
            vals = [acc[...] for acc in accs]
            out = (reference.situ(*(v.astype(jnp.bfloat16) for v in vals), BETA, LINEAR_BETA)
                   if parts == 2 else vals[0].astype(jnp.bfloat16))
            tma._store_rows(out, out_gmem, tile * rows, batch)

        pl.run_scoped(scope, *[plgpu.ACC((batch, rows), jnp.float32)] * parts)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, n_out), jnp.bfloat16), grid=(tiles,),
        grid_names=("tile",), interpret=tma._interpret_params(interpret),
        kernel_name=f"x_registers_{'gate_up' if parts == 2 else 'down'}",
    )(x, w)


def variants(kernel: str, interpret: bool, small: bool):
    """(label, function, the ``rows`` whose package output its bits must equal)."""
    parts, depth = (2, 4) if kernel == "gate_up" else (1, 6)
    package = tma_probes.package_gate_up if kernel == "gate_up" else tma_probes.package_down
    table_rows = 48 if kernel == "gate_up" else 56
    for rows in (table_rows, 64):
        if small and rows != 64:
            continue
        common = dict(rows=rows, depth=3 if interpret else depth, interpret=interpret)
        yield (f"package batch_m r{rows}",
               functools.partial(package, block_k=BLOCK_K, batch_m=True, **common), None)
        for prefetch in (1, 2, 3):
            yield (f"registers r{rows} ahead {prefetch}",
                   functools.partial(registers_kernel, parts=parts, prefetch=prefetch, **common),
                   rows)
    yield "xla row sum", tma_probes.xla_row_sum, None


def main() -> None:
    args, device = tma_probes.start(__doc__, "64")
    s_r, hidden, copies = tma_probes.weights(args.interpret)
    rows = []
    for batch in map(int, args.batches.split(",")):
        if batch != TMA_MAX_BATCH:
            raise SystemExit(f"--batches: {TMA_MAX_BATCH} only (x is wgmma's M), got {batch}")
        x, h, small = tma_probes.operands(batch, s_r, hidden)
        for kernel, operand in (("gate_up", x), ("down", h)):
            weights = copies[kernel] if copies else [small[kernel]]
            package = {}  # rows -> the package's batch_m output
            for name, fn, check_rows in variants(kernel, args.interpret, copies is None):
                row = dict(batch=batch, kernel=kernel, variant=name)
                out = tma_probes.run_variant(fn, operand, weights, row, args.interpret)
                if name.startswith("package") and out is not None:
                    package[int(name.rsplit("r", 1)[1])] = out
                if check_rows and out is not None and check_rows in package:
                    row["same_bits"] = bool(np.array_equal(out, package[check_rows]))
                rows.append(row)
                print(json.dumps(row), flush=True)
    tma_probes.report(rows, args.out, "x_registers_probe", device.device_kind,
                      "bits equal to the package's batch_m at its rows")


if __name__ == "__main__":
    main()
