"""A call's span on the GPU: its first kernel's start to its last kernel's end, from a profiler
trace of ``CHAIN`` calls, one after another, in one jitted program.

CUPTI's summed kernel time (``front_gemm_timing.cupti_us_per_call``) leaves out the gaps between a
call's kernels, which a decode step waits for: XLA launches its kernels with programmatic dependent
launch, so each starts as the one before ends, and the Mosaic GPU kernels that wait first thing
(``shared_expert_tma.LAUNCH_WITH_PDL``) do the same; the Triton kernels (``jax-triton``, Pallas'
Triton lowering) do not. ``span`` measures what such a call takes, gaps included. It holds the
profiler, as CUPTI's timing does, so it runs after all of that.
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import re
import tempfile

import jax
import numpy as np
from jax import lax

CHAIN = 8
"""Calls per jitted program in the span measure."""


def chain_program(fn, xs, pairs):
    """A jitted, warmed program of ``len(xs)`` calls, one after another: call i on ``xs[i]`` and
    ``pairs[i]`` (no operand shared, so XLA merges no dots across calls), its ``xs[i]`` passed
    through an optimization barrier with call i - 1's output, so that XLA cannot start a call
    before the one before it has finished, nor interleave their kernels (it did, with independent
    calls: twenty-first session), as the layers of a decode step follow one another."""

    def calls(xs, ws):
        outs = [fn(xs[0], ws[0])]
        for x, w in zip(xs[1:], ws[1:]):
            _, x = lax.optimization_barrier((outs[-1], x))
            outs.append(fn(x, w))
        return outs

    program = jax.jit(calls)
    jax.block_until_ready(program(xs, pairs))
    return functools.partial(program, xs, pairs)


def kernel_kind(name: str) -> str:
    """A kernel's name without what differs between programs: XLA's fusion numbers
    (``loop_convert_fusion_1``) and Mosaic GPU's suffix."""
    return re.sub(r"(_\d+)+$", "", name.removesuffix("_mosaic_gpu_kernel"))


def call_spans(timeline: list, kernels_per_call: int) -> list[float]:
    """Each call's span in a program's ``timeline`` (``(name, start, duration)`` in time order):
    from its first kernel's start to its last kernel's end, in microseconds."""
    calls = [timeline[at:at + kernels_per_call] for at in range(0, len(timeline), kernels_per_call)]
    return [max(start + duration for _, start, duration in call) - call[0][1] for call in calls]


def span(row: dict, program, programs: int = 12) -> None:
    """For ``program`` (``chain_program``'s; ``row["kernels"]`` the kernels of one call), from a
    profiler trace of ``programs`` programs run one at a time: ``spans_of``'s keys in ``row``. The
    trace keeps the kernels of only some programs (three of twelve in ``pdl_probe``'s runs). It
    holds CUPTI, as the CUPTI timing does, so it runs after all of that."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(programs):
                jax.block_until_ready(program())
        trace_file, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
        with gzip.open(trace_file) as f:
            row.update(spans_of(json.load(f)["traceEvents"], row["kernels"]))


def spans_of(events: list[dict], call_kernels: list[str]) -> dict:
    """From a trace's ``events`` (Chrome trace format) of ``chain_program`` programs whose calls
    each launch ``call_kernels``, in order: ``call_span_us``, the median over the traced calls of
    a call's span (its first kernel's start to its last kernel's end: the gap between its kernels
    counts, and so does the overlap PDL gives); ``timeline``, each traced program's kernels as
    ``(name, start, duration)`` in microseconds from its first start; ``programs_traced``. The gaps
    between calls may hold the host's launches (the trace's own cost included), so no span across
    calls is taken. A count of kernels on the GPU's streams that is not a whole number of
    programs, or a program whose kernels are not its calls' one after another (``kernel_kind``),
    gives ``span_error`` alone."""
    streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
               and e.get("name") == "thread_name"
               and e.get("args", {}).get("name", "").startswith("Stream")}
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams)
    per_call = len(call_kernels)
    size = per_call * CHAIN
    if not kernels or len(kernels) % size:
        return dict(span_error=f"{len(kernels)} events on the GPU's streams, not a whole number "
                               f"of programs of {size} kernels")
    programs = [kernels[at:at + size] for at in range(0, len(kernels), size)]
    expected = [kernel_kind(name) for name in call_kernels] * CHAIN
    if any([kernel_kind(name) for _, _, name in program] != expected for program in programs):
        return dict(span_error="a traced program's kernels are not its calls' one after another")
    timeline = [[(name, round(start - program[0][0], 2), round(end - start, 2))
                 for start, end, name in program] for program in programs]
    return dict(programs_traced=len(programs), timeline=timeline, call_span_us=float(np.median(
        [s for one in timeline for s in call_spans(one, per_call)])))
