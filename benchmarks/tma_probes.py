"""Pieces shared by the probes of the shared expert's TMA kernels (``warp_specialized_probe``,
``tiled_weight_probe``, ``batch_cost_probe``, ``x_registers_probe``, ``merged_gate_up_probe``):
the package's kernels at a given stage width and ring, the probes' data, and the run of one
variant (compile, output, CUPTI time) and the results' table."""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax.pallas import shared_expert_tma as tma
from moe_front_jax.pallas.streaming import GemmConfig

ROWS = 64
BETA, LINEAR_BETA = 4.0, 25.0


def start(doc: str, batches: str, extra=None) -> tuple[argparse.Namespace, jax.Device]:
    """A probe's arguments (``--out``, ``--batches``, default ``batches``; ``--interpret``; those
    ``extra(parser)`` adds) and its device, printed with the time."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default=batches)
    parser.add_argument("--interpret", action="store_true",
                        help="check the bits on a small shape in interpret mode, no timing")
    if extra:
        extra(parser)
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    return args, device


def package_gate_up(x, gate_up, *, block_k, depth, rows=ROWS, batch_m=False, interpret=False):
    """The package's TMA gate/up with situ, CTAs of ``rows`` rows (``batch_m``: the batch as
    wgmma's M), no split of K."""
    config = GemmConfig(rows, block_k, 1, 4, depth, tma=True, batch_m=batch_m)
    return tma.gate_up_situ(x, gate_up, BETA, LINEAR_BETA, config=config, interpret=interpret)


def package_down(hidden, down, *, block_k, depth, rows=ROWS, batch_m=False, interpret=False):
    """The package's TMA down, CTAs of ``rows`` rows (``batch_m``: the batch as wgmma's M), no
    split of K."""
    config = GemmConfig(rows, block_k, 1, 4, depth, tma=True, batch_m=batch_m)
    return tma.down_proj(hidden, down, config=config, interpret=interpret)


def xla_row_sum(x, w):
    """The read ceiling: XLA's row sum of the weight (``x`` unused)."""
    del x
    return w.astype(jnp.float32).sum(axis=1)


def weights(interpret: bool) -> tuple[int, int, dict | None]:
    """``(S_r, H, copies)``: K3's tp1 shape and its rotated weight copies (``gate_up``, ``down``)
    on the GPU; a small shape and no copies in interpret mode (``operands`` makes its weights)."""
    if interpret:
        return 128, 512, None
    from shared_expert_timing import Shape, down_copies, gate_up_copies
    shape = Shape.k3(1)
    return shape.shared, shape.hidden, dict(gate_up=gate_up_copies(shape), down=down_copies(shape))


def operands(batch: int, s_r: int, hidden: int) -> tuple[jax.Array, jax.Array, dict]:
    """Random ``x`` ``[B, H]``, ``hidden`` ``[B, S_r]`` and small weights, seeded by the batch."""
    keys = jax.random.split(jax.random.key(batch), 4)
    x = jax.random.normal(keys[0], (batch, hidden), jnp.float32).astype(jnp.bfloat16)
    h = jax.random.normal(keys[1], (batch, s_r), jnp.float32).astype(jnp.bfloat16)
    small = dict(
        gate_up=(jax.random.normal(keys[2], (2 * s_r, hidden)) / 20).astype(jnp.bfloat16),
        down=(jax.random.normal(keys[3], (hidden, s_r)) / 20).astype(jnp.bfloat16))
    return x, h, small


def run_variant(fn, operand, copies, row: dict, interpret: bool) -> np.ndarray | None:
    """Compile ``fn(operand, copies[0])``, return its output as float32, and (off interpret mode)
    time it with CUPTI over ``copies``, into ``row`` (``us``, ``kernels``, ``tbs``); a failure is
    ``row["error"]`` and returns None."""
    try:
        compiled = jax.jit(fn).lower(operand, copies[0]).compile()
        out = np.asarray(compiled(operand, copies[0]).astype(jnp.float32))
        if not interpret:
            from front_gemm_timing import cupti_us_per_call
            row["us"], row["kernels"] = cupti_us_per_call(compiled, operand, copies, rounds=5)
            nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(copies[0]))
            row["tbs"] = nbytes / row["us"] / 1e6
        return out
    except Exception as e:  # noqa: BLE001 -- a variant that fails is a row of the table
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return None


def report(rows: list[dict], out_dir: str, name: str, device_kind: str, same_bits: str,
           title: str = "shared expert at tp1", label=None, check: str = "same_bits") -> None:
    """Write ``rows`` to ``out_dir/name.json`` and print the table under ``title``: each row's
    ``label(row)`` (default: its batch, kernel and variant), us per kernel and TB/s of weight
    read, and its ``check`` entry (described by ``same_bits``)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(dict(device=device_kind, rows=rows), f, indent=1)
    label = label or (lambda r: f"B={r['batch']:>2} {r['kernel']:>7} {r['variant']:>18}")
    print(f"\n{title} ({device_kind}): us per kernel, TB/s of weight read")
    for r in rows:
        result = (f"{r['us']:7.2f} us {r['tbs']:.2f} TB/s" if "us" in r else
                  r.get("error", "")[:70] or "(not timed)")
        print(f"{label(r)}: {result}  {same_bits}: {r.get(check, '-')}")
