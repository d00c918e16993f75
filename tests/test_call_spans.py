"""The span measure of benchmarks/timing.py on synthetic traces (CPU): spans of calls in order,
and the error for a trace whose calls interleave (XLA did so with independent calls at tp8 B=1)
or whose kernels do not split into programs."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def call_spans():
    spec = importlib.util.spec_from_file_location("bench_timing", BENCHMARKS / "timing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def trace(kernels):
    """Chrome-trace events: a GPU stream's name, then ``(name, start, duration)`` kernels on it,
    and one event on a host thread that must be ignored."""
    events = [dict(ph="M", name="thread_name", pid=1, tid=7, args=dict(name="Stream #13")),
              dict(ph="M", name="thread_name", pid=2, tid=3, args=dict(name="python3")),
              dict(ph="X", name="host_work", pid=2, tid=3, ts=0.0, dur=1000.0)]
    events += [dict(ph="X", name=n, pid=1, tid=7, ts=t, dur=d) for n, t, d in kernels]
    return events


def program(call_spans, start, gate_up=9.0, gap=1.5, down=3.0, between=20.0):
    """One traced program: CHAIN calls of gate/up then down (XLA's fusion numbers differ from the
    names CUPTI gave), calls ``between`` us apart."""
    kernels, t = [], start
    for _ in range(call_spans.CHAIN):
        kernels += [("shared_gate_up_tma_partials_mosaic_gpu_kernel", t, gate_up),
                    ("loop_convert_fusion_3", t + gate_up + 0.1, 1.0),
                    ("shared_down", t + gate_up + gap, down)]
        t += between
    return kernels


CALL = ["shared_gate_up_tma_partials_mosaic_gpu_kernel", "loop_convert_fusion", "shared_down"]


def test_spans_of_calls_in_order(call_spans):
    found = call_spans.spans_of(trace(program(call_spans, 100.0)
                                      + program(call_spans, 900.0, gap=2.5)), CALL)
    assert "span_error" not in found
    assert found["programs_traced"] == 2
    assert found["call_span_us"] == pytest.approx((9.0 + 1.5 + 3.0 + 9.0 + 2.5 + 3.0) / 2)
    assert found["timeline"][1][2] == ("shared_down", 2.5 + 9.0, 3.0)


def test_interleaved_calls_are_an_error_not_a_span(call_spans):
    kernels = program(call_spans, 100.0)
    name, _, duration = kernels[3]
    kernels[3] = (name, 105.0, duration)  # call 2's gate/up starts before call 1's down
    found = call_spans.spans_of(trace(kernels), CALL)
    assert set(found) == {"span_error"} and "one after another" in found["span_error"]


def test_kernels_that_are_not_whole_programs_are_an_error(call_spans):
    found = call_spans.spans_of(trace(program(call_spans, 100.0)[:-1]), CALL)
    assert set(found) == {"span_error"} and "whole number" in found["span_error"]
    assert "span_error" in call_spans.spans_of(trace([]), CALL)


def test_chain_program_orders_the_calls(call_spans):
    """Call i reads its rows only through a barrier with call i - 1's output: the lowered program
    holds one barrier a call after the first, and the calls' results are each call's own."""
    fn = lambda x, w: x @ w  # noqa: E731
    xs = [jnp.full((2, 3), float(i)) for i in range(call_spans.CHAIN)]
    ws = [jnp.eye(3) * (i + 1) for i in range(call_spans.CHAIN)]
    run = call_spans.chain_program(fn, xs, ws)
    outs = run()
    assert [float(o[0, 0]) for o in outs] == [i * (i + 1) for i in range(call_spans.CHAIN)]
    text = jax.jit(run.func).lower(*run.args).as_text()
    assert text.count("optimization_barrier") == call_spans.CHAIN - 1


def test_programs_are_cut_where_the_gpu_idles(call_spans):
    """``programs_of``: kernels 2 ms apart start a new program, whatever their names; each
    program's times count from its own first start."""
    # A long kernel (900 us) ends 100 us before the next starts: one program, though the starts
    # are 1000 us apart.
    first = [("fusion_1", 100.0, 5.0), ("kernel_a", 106.0, 900.0), ("fusion_7", 1106.0, 2.0)]
    second = [("fusion_2", 3300.0, 4.0), ("kernel_a", 3305.0, 3.0)]
    programs = call_spans.programs_of(trace(first + second))
    assert programs == [[("fusion_1", 0.0, 5.0), ("kernel_a", 6.0, 900.0), ("fusion_7", 1006.0, 2.0)],
                        [("fusion_2", 0.0, 4.0), ("kernel_a", 5.0, 3.0)]]
    assert call_spans.programs_of(trace([])) == []
