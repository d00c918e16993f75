"""Does programmatic dependent launch (PDL) shorten the shared expert's call? (GPU; ``--interpret``
checks the kernels' bits on the CPU.)

  python benchmarks/pdl_probe.py --out $OUT [--tps 1,8] [--batches 1,64] [--interpret]

The call is two kernels, gate/up then down, and the down cannot start before the gate/up (and, at
tp8, XLA's split-K epilogue) is done. Mosaic GPU launches a kernel that calls
``plgpu.griddepcontrol_wait`` with PDL: it may start once every program of the kernel before it has
called ``griddepcontrol_launch_dependents`` or exited, and ``griddepcontrol_wait`` holds it until
that kernel has finished and its writes are visible. So a down kernel can copy the first stages of
its weight (which no earlier kernel of the call writes) into shared memory before the wait, and
``hidden`` after it: its ramp overlaps the gate/up's tail and the launch gap. At tp8 (K = 768) a
ring of 6 stages of 128 columns is the down CTA's whole weight tile.

Variants (the package's TMA kernels written with a ring of our own, so that the weight and the
activation copies of each stage can be issued apart; 64-row CTAs, no K split in the down; every
output bfloat16, tp8's too, where ``moe_front`` asks the float32 partial sum):

  ring       our ring, no PDL (the control for the three below)
  package    the package's kernels at the same stages (tp1: the TMA gate/up and down; tp8: the
             table's schedules, not bit-equal to ring's), each of its TMA kernels waiting first
             thing (``shared_expert_tma.LAUNCH_WITH_PDL``)
  no PDL     the same with ``LAUNCH_WITH_PDL`` off, as the package ran before this probe
  pdl        the down waits after its weight prologue (tp8: behind XLA's split-K epilogue, which
             follows the package's TMA gate/up split 8 ways with ``batch_m``)
  pdl+early  and the gate/up calls ``griddepcontrol_launch_dependents`` as it starts, so that the
             down CTAs take the SMs the gate/up leaves idle (tp1: 96 gate/up CTAs on 132 SMs)
  pdl both   the gate/up waits too (after its own weight prologue) and both trigger early, so a
             call's gate/up overlaps the previous call's down

Each is checked bit for bit against ``ring``, then timed two ways over weight copies rotated past
the L2: CUPTI's summed kernel time per call (``run_variant``; a kernel launched early counts its
wait, so PDL can only look slower there), and a call's span, its first kernel's start to its last
kernel's end, from the profiler's trace of ``CHAIN`` calls in one jitted program (distinct rows
and weights per call; since the twenty-first session each call after the one before, as
``call_spans.chain_program`` orders them): what a decode step waits, the gap between the kernels
included. XLA's
reference stage is timed both ways beside them. The recorded runs turned XLA's command buffers
off (``XLA_FLAGS=--xla_gpu_enable_command_buffer=``), so that every kernel is a stream launch; one
run with them on gave the same spans (whether its traced programs ran as CUDA graphs, the trace
does not say). The table prints last; rows go to $OUT/pdl_probe.json.

Found on an H100 (benchmarks/RESULTS.md, twentieth session; no H200 came): XLA launches its own
kernels with PDL (each starts 0.1-0.4 us before the one it follows ends), and the package's TMA
kernels did not: the down started 1.2-2.5 us after the gate/up. Waiting first thing
(``LAUNCH_WITH_PDL``, now the package's) takes that gap out: tp1 spans 88.4 against 90.2 us at
B=1 and 94.1 against 96.8 at B=64, CUPTI's sums level. The weight prologue before the wait
(``pdl``) gains nothing more, as our ring costs 0.6-2.1 us of kernel time against the package's
pipeline; ``pdl+early`` is level with the package at B=64 and behind at B=1, and ``pdl both`` is
slower. Spans at tp8 hold the host's launches (XLA's command buffers off) and say little; at tp8
B=1 XLA also ran two calls' gate/ups before their downs, which ``call_spans.chain_program`` now
prevents, and ``call_spans.span`` reports (twenty-first session).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import tma_probes
from call_spans import CHAIN, chain_program, span
from moe_front_jax import reference
from moe_front_jax.pallas import shared_expert as se
from moe_front_jax.pallas import shared_expert_tma as tma
from moe_front_jax.pallas.streaming import GemmConfig
from shared_expert_timing import Shape, random_copies
from shared_expert_timing import rows as rows_of
from tma_probes import BETA, LINEAR_BETA, ROWS


def _ring(x_gmem, w_gmem, first_rows, *, block_k: int, depth: int, bp: int, wait: bool):
    """The float32 ``[64, bp]`` products of the 64-row weight tiles starting at rows ``first_rows``
    with ``x`` over all of K in steps of ``block_k`` columns, through a ring of ``depth`` TMA
    stages. The weight's copies of the first ``depth`` stages are issued before
    ``griddepcontrol_wait`` (where ``wait``), ``x``'s after it; each later stage refills the slot of
    the step whose wgmmas just finished (one step of wgmmas in flight, as the package's). Interpret
    mode runs the kernels one after another and has no rule for PDL's instructions: there the
    callers pass ``wait`` and ``early`` False."""
    steps = x_gmem.shape[1] // block_k
    depth = min(depth, steps)
    transforms = tma._transforms(block_k)
    parts = len(first_rows)

    def scope(x_smem, barriers, *w_smem, accs):

        def load_w(step, slot):
            for rows, smem in zip(first_rows, w_smem):
                plgpu.copy_gmem_to_smem(
                    w_gmem.at[pl.ds(rows, ROWS), pl.ds(step * block_k, block_k)],
                    smem.at[slot], barriers.at[slot])

        def load_x(step, slot):
            plgpu.copy_gmem_to_smem(
                x_gmem.at[pl.ds(0, bp), pl.ds(step * block_k, block_k)],
                x_smem.at[slot], barriers.at[slot])

        for s in range(depth):
            load_w(s, s)
        if wait:
            plgpu.griddepcontrol_wait()
        for s in range(depth):
            load_x(s, s)

        def body(step, carry):
            slot = lax.rem(step, depth)
            plgpu.barrier_wait(barriers.at[slot])
            for acc, w in zip(accs, w_smem):
                plgpu.wgmma(acc, w.at[slot], x_smem.at[slot].T)
            plgpu.wgmma_wait(parts)  # the previous step's wgmmas are done: refill their slot
            refill = step - 1 + depth

            @pl.when((step >= 1) & (refill < steps))
            def _():
                load_w(refill, lax.rem(refill, depth))
                load_x(refill, lax.rem(refill, depth))

            return carry

        lax.fori_loop(0, steps, body, 0)
        return tuple(acc[...] for acc in accs)

    def with_accs(*accs):
        return pl.run_scoped(
            functools.partial(scope, accs=accs),
            plgpu.SMEM((depth, bp, block_k), jnp.bfloat16, transforms=transforms),
            plgpu.Barrier(num_arrivals=parts + 1, num_barriers=depth),
            *[plgpu.SMEM((depth, ROWS, block_k), jnp.bfloat16, transforms=transforms)] * parts,
        )

    return pl.run_scoped(with_accs, *[plgpu.ACC((ROWS, bp), jnp.float32)] * parts)


def _kernel(body, out_shape, grid, names, interpret, name, *operands):
    return plgpu.kernel(body, out_type=out_shape, grid=grid, grid_names=names,
                        interpret=tma._interpret_params(interpret), kernel_name=name)(*operands)


def gate_up(x, gate_up_w, *, block_k, depth, wait=False, early=False, interpret=False):
    """``situ(bf16(x @ gate.T), bf16(x @ up.T))`` ``[B, S_r]`` through ``_ring``, K whole (tp1)."""
    batch = x.shape[0]
    s_r, bp = gate_up_w.shape[0] // 2, tma.padded_batch(batch)
    ring = functools.partial(_ring, block_k=block_k, depth=depth, bp=bp, wait=wait)

    def kernel(x_gmem, w_gmem, out_gmem):
        if early:
            plgpu.griddepcontrol_launch_dependents()
        tile = lax.axis_index("tile")
        gate, up = ring(x_gmem, w_gmem, (tile * ROWS, s_r + tile * ROWS))
        hidden = reference.situ(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), BETA,
                                LINEAR_BETA)
        tma._store_transposed(hidden, out_gmem, tile * ROWS)

    return _kernel(kernel, jax.ShapeDtypeStruct((batch, s_r), jnp.bfloat16), (s_r // ROWS,),
                   ("tile",), interpret, "probe_gate_up", x, gate_up_w)


def split_gate_up(x, gate_up_w, *, block_k, depth, interpret=False):
    """The package's TMA gate/up split 8 ways with ``batch_m`` (tp8): ``hidden`` ``[Bp, S_r]``
    batch-major from XLA's epilogue, as ``_ring`` reads it."""
    config = GemmConfig(ROWS, block_k, 8, 4, depth, tma=True, batch_m=True)
    return tma._split_hidden(x, gate_up_w, BETA, LINEAR_BETA, config, interpret)


def down(hidden, down_w, *, block_k, depth, wait=False, early=False, interpret=False):
    """``hidden @ down.T`` ``[B, H]`` bfloat16 (float32 accumulation) through ``_ring``."""
    batch = hidden.shape[0]
    h, bp = down_w.shape[0], tma.padded_batch(batch)
    ring = functools.partial(_ring, block_k=block_k, depth=depth, bp=bp, wait=wait)

    def kernel(h_gmem, w_gmem, out_gmem):
        if early:
            plgpu.griddepcontrol_launch_dependents()
        tile = lax.axis_index("tile")
        (acc,) = ring(h_gmem, w_gmem, (tile * ROWS,))
        tma._store_transposed(acc.astype(jnp.bfloat16), out_gmem, tile * ROWS)

    return _kernel(kernel, jax.ShapeDtypeStruct((batch, h), jnp.bfloat16), (h // ROWS,),
                   ("tile",), interpret, "probe_down", hidden, down_w)


def _without_pdl(fn):
    """``fn`` traced with ``shared_expert_tma.LAUNCH_WITH_PDL`` off."""
    def traced(x, w):
        saved, tma.LAUNCH_WITH_PDL = tma.LAUNCH_WITH_PDL, False
        try:
            return fn(x, w)
        finally:
            tma.LAUNCH_WITH_PDL = saved

    return traced


def variants(tp: int, cfg, args) -> dict:
    """name -> ``fn(x, (gate_up, down))`` for the probe's variants at ``tp``."""
    gu = dict(block_k=args.gate_up_stages[0], depth=args.gate_up_stages[1])
    dn = dict(block_k=args.down_stages[0], depth=args.down_stages[1])
    interpret = dict(interpret=True) if args.interpret else {}
    pdl = not args.interpret  # interpret mode: the same kernels without PDL's instructions
    if tp == 1:
        configs = dict(gate_up_config=GemmConfig(ROWS, gu["block_k"], 1, 4, gu["depth"], tma=True),
                       down_config=GemmConfig(ROWS, dn["block_k"], 1, 4, dn["depth"], tma=True))

        def chain(gate_up_kw, down_kw):
            return lambda x, w: down(gate_up(x, w[0], **gu, **gate_up_kw, **interpret), w[1],
                                     **dn, **down_kw, **interpret)

        found = dict(ring=chain({}, {}), package=lambda x, w: tma.shared_expert(
            x, *w, BETA, LINEAR_BETA, **configs, **interpret))
        found["no PDL"] = _without_pdl(found["package"])
        found["pdl"] = chain({}, dict(wait=pdl))
        found["pdl+early"] = chain(dict(early=pdl), dict(wait=pdl))
        found["pdl both"] = chain(dict(wait=pdl, early=pdl), dict(wait=pdl, early=pdl))
    else:
        def chain(down_kw):
            return lambda x, w: down(split_gate_up(x, w[0], **gu, **interpret), w[1], **dn,
                                     **down_kw, **interpret)

        found = dict(ring=chain({}), pdl=chain(dict(wait=pdl)))
        if not args.interpret:  # the table's schedule: the Triton down, not bit-equal to ring's
            found["package"] = lambda x, w: se.shared_expert(
                x, *w, cfg, jnp.bfloat16,
                config=se.pick_config(cfg.shared_per_rank, cfg.hidden, x.shape[0]))
            found["no PDL"] = _without_pdl(found["package"])
    if not args.interpret:
        found["xla"] = lambda x, w: reference.shared_expert(x, *w, cfg, jnp.bfloat16)
    return found


def _stages(text: str) -> tuple[int, int]:
    block_k, depth = map(int, text.split(","))
    return block_k, depth


def main() -> None:
    def extra(parser):
        parser.add_argument("--tps", default="1,8")
        parser.add_argument("--gate-up-stages", type=_stages, default=(128, 4),
                            help="block_k,depth of the gate/up's ring (default 128,4)")
        parser.add_argument("--down-stages", type=_stages, default=(128, 6),
                            help="block_k,depth of the down's ring (default 128,6)")

    args, device = tma_probes.start(__doc__, "1,64", extra)
    if args.interpret:  # a small shape: K = 512 in 8 steps, so that tp8's split of 8 divides it
        args.gate_up_stages = args.down_stages = (64, 3)
    rows, jobs = [], []
    for tp in map(int, args.tps.split(",")):
        shape = Shape.k3(tp)
        s_r, hidden = (128, 512) if args.interpret else (shape.shared, shape.hidden)
        if not args.interpret:  # one distinct weight pair per call of a program
            nbytes = CHAIN * shape.weight_bytes
            pairs = list(zip(random_copies((2 * s_r, hidden), hidden, nbytes, tp),
                             random_copies((hidden, s_r), s_r, nbytes, 100 + tp)))[:CHAIN]
        for batch in map(int, args.batches.split(",")):
            x, _, small = tma_probes.operands(batch, s_r, hidden)
            if args.interpret:
                xs, pairs = [x], [(small["gate_up"], small["down"])]
            else:
                xs = [rows_of(batch, hidden, seed=i) for i in range(CHAIN)]
            outs = {}
            for name, fn in variants(tp, shape.cfg, args).items():
                row = dict(tp=tp, batch=batch, variant=name)
                outs[name] = tma_probes.run_variant(fn, xs[0], pairs, row, args.interpret)
                if outs[name] is not None and outs["ring"] is not None and name != "xla" and not (
                        tp > 1 and name in ("package", "no PDL")):
                    row["same_bits"] = bool(np.array_equal(outs[name], outs["ring"]))
                if not args.interpret and "error" not in row:
                    jobs.append((row, chain_program(fn, xs, pairs)))
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row, program in jobs:
        span(row, program)
        print(row["variant"], row.get("call_span_us", row.get("span_error")),
              row.get("programs_traced"), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pdl_probe.json"), "w") as f:  # a row a line
        f.write(f'{{"device": {json.dumps(device.device_kind)}, "chain": {CHAIN}, "rows": [\n')
        f.write(",\n".join(json.dumps(row) for row in rows) + "\n]}\n")
    print(f"\nshared expert ({device.device_kind}): us per call; CUPTI = summed kernel time, "
          f"span = a call's first kernel start to last kernel end (median, traced calls of "
          f"{CHAIN} back to back); bits against ring")
    for r in rows:
        timed = (f"CUPTI {r['us']:6.2f}  span {r.get('call_span_us', float('nan')):6.2f}"
                 if "us" in r
                 else r.get("error", "")[:70] or "(not timed)")
        timed += f" {r['span_error']}" if "span_error" in r else ""
        print(f"tp{r['tp']} B={r['batch']:>2} {r['variant']:>10}: {timed}  "
              f"same bits: {r.get('same_bits', '-')}")


if __name__ == "__main__":
    main()
