"""The front's plan against what the traced program runs.

The runner traces every step under a name scope (``Step.scope``), so each kernel the program holds
can be traced back to the step that asked for it: a Pallas kernel in interpret mode is a
``pallas_call`` in the jaxpr, a kernel lowered for an H200 a custom call in the StableHLO whose
location carries the scope. For each path (one device, one rank inside ``shard_map``, the sharded
params' ``shard_map``, each with or without a mailbox) and backend, the steps the plan marks as
kernels must be exactly the steps that hold a kernel, and the others must hold none.
"""

import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import moe_front_jax as mf
from moe_front_jax import mailbox as mb
from moe_front_jax import planner, registry
from h200 import H200, verified_triton_modules

CFG = mf.FrontConfig(hidden=256, experts=64, top_k=8, latent=128, shared=64)
NO_SHARED = dataclasses.replace(CFG, shared=0)
STEP = re.compile(r"plan_step(\d+)_")


def params_of(cfg):
    return mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)


def rows(batch, hidden=CFG.hidden):
    return jax.random.normal(jax.random.key(batch), (batch, hidden)).astype(jnp.bfloat16)


def kernel_steps(front: planner.FrontPlan) -> set[int]:
    """The numbers of the steps that run a kernel, the steps after a ``shard_map`` included."""
    return {index for index, step in enumerate(front.steps + front.after, 1) if step.kernel}


KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")
"""A Pallas Triton kernel, and a Mosaic GPU one (``plgpu.kernel``), in a jaxpr."""


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def pallas_steps(jaxpr, stack: str = "") -> list[int | None]:
    """The plan step of every kernel in ``jaxpr`` (None: outside any step)."""
    found = []
    for eqn in jaxpr.eqns:
        here = f"{stack}/{eqn.source_info.name_stack}"
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            match = STEP.findall(here)
            found.append(int(match[-1]) if match else None)
            continue
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                found += pallas_steps(sub, here)
    return found


def traced_kernel_steps(fn, *args) -> list[int | None]:
    return pallas_steps(jax.make_jaxpr(fn)(*args).jaxpr)


def lowered_kernel_steps(fn, *args) -> list[int | None]:
    """The plan step of every kernel custom call of ``jax.jit(fn)`` lowered for an H200."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh), verified_triton_modules():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(
            debug_info=True)
    locations = dict(re.findall(r"^(#loc\d+) = (loc\(.*\))$", text, re.M))
    found = []
    for line in text.splitlines():
        if "stablehlo.custom_call" not in line:
            continue
        location = re.search(r"loc\((#loc\d+)\)\s*$", line)
        match = STEP.findall(locations.get(location.group(1), "") if location else "")
        found.append(int(match[-1]) if match else None)
    return found


def explain_for_h200(*args, **kwargs) -> planner.FrontPlan:
    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return mf.explain(*args, **kwargs)


def assert_matches(front: planner.FrontPlan, found: list[int | None]) -> None:
    assert None not in found, f"a kernel outside every step of\n{front}"
    assert set(found) == kernel_steps(front), f"kernels in steps {sorted(set(found))} of\n{front}"


ONE_DEVICE = [
    dict(),
    dict(plan=True),
    dict(plan=True, permute=True),
    dict(permute=True),
]


def one_device_stages(backend: str, shared: bool, plan: bool) -> tuple[str, ...]:
    """The stages the one-device path ran before the plan existed (b0fc3e6's ``api.moe_front``):
    with a shared expert and the engine's kernels (``"interpret"``) the merged front; else the
    GEMM, its plan epilogue where its kernel runs, or the plan stage."""
    if shared and backend == "interpret":
        return ("front_gate_up", "route", "shared_down")
    if plan:
        gemm = ("front_gemm_plan",) if backend == "interpret" else ("front_gemm", "plan")
    else:
        gemm = ("front_gemm",)
    return (*gemm, "route", *(("shared_expert",) if shared else ()))


def mailbox_stages(backend: str, shared: bool, plan: bool) -> tuple[str, ...]:
    """The same with a mailbox: the GEMM's epilogue publishes where its kernel runs unmerged; the
    routing kernel that polls collects where it runs and the plan is asked for."""
    merged = shared and backend == "interpret"
    if backend == "interpret" and not merged:
        front = ("front_gemm_publish",)
    else:
        front = ("front_gate_up" if merged else "front_gemm", "mailbox_publish")
    if plan and backend == "interpret":
        collect = ("route_collect",)
    else:
        collect = ("mailbox_collect", "route", *(("plan",) if plan else ()))
    tail = ("shared_down",) if merged else ("shared_expert",) if shared else ()
    return (*front, *collect, *tail)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("options", ONE_DEVICE, ids=str)
@pytest.mark.parametrize("cfg", [CFG, NO_SHARED], ids=["shared", "no_shared"])
def test_one_device_plan_is_what_runs(backend, options, cfg):
    params, x = params_of(cfg), rows(5)
    front = mf.explain(x, params, backend=backend, **options)
    assert front.path == "one device" and front.runs_kernels == (backend == "interpret")
    assert front.stages() == one_device_stages(backend, cfg.shared > 0, options.get("plan", False))
    found = traced_kernel_steps(partial(mf.moe_front, backend=backend, **options), x, params)
    assert_matches(front, found)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("plan", [False, True])
@pytest.mark.parametrize("cfg", [CFG, NO_SHARED], ids=["shared", "no_shared"])
def test_one_device_mailbox_plan_is_what_runs(backend, plan, cfg):
    params, x = params_of(cfg), rows(5)
    box = mf.Mailbox.create(cfg, capacity=8)
    front = mf.explain(x, params, backend=backend, plan=plan, mailbox=box)
    assert front.stages() == mailbox_stages(backend, cfg.shared > 0, plan)
    epilogue = backend == "interpret" and not cfg.shared
    assert front.transport == ("epilogue" if epilogue else "gather")
    found = traced_kernel_steps(
        lambda x, p, b: mf.moe_front(x, p, backend=backend, plan=plan, mailbox=b)[0], x, params, box)
    assert_matches(front, found)


def rank_call(params, mesh, backend, mailbox=None, **options):
    """``moe_front`` inside the caller's ``shard_map``: its plan and the function to trace."""
    specs = jax.tree.map(lambda a: a.sharding.spec, params)

    def body(x, local, boxes):
        box = None if boxes is None else jax.tree.map(lambda a: a[0], boxes)
        out = mf.moe_front(x, local, axis_name="tp", backend=backend, mailbox=box, **options)
        return (out if box is None else out[0]).ids

    boxes = None
    if mailbox:
        one = mf.Mailbox.create(params.cfg, capacity=8)
        boxes = jax.tree.map(lambda a: jax.device_put(jnp.stack([a] * mesh.size),
                                                       NamedSharding(mesh, P("tp"))), one)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("tp")), out_specs=P(),
                       check_vma=False)
    return fn, boxes


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("mailbox", [False, True])
def test_rank_plan_is_what_runs(backend, mailbox):
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    sharded = mf.shard_params(mf.init_weights(jax.random.key(0), CFG), CFG, mesh)
    x = rows(4)
    local = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape), a.dtype),
                         sharded)
    box = mf.Mailbox.create(sharded.cfg, capacity=8) if mailbox else None
    front = mf.explain(x, local, axis_name="tp", backend=backend, plan=True, mailbox=box)
    assert front.path == "one rank"
    assert ("exchange" in front.stages()) == (not mailbox)
    assert front.stages()[-2:] == ("shared_expert", "reduce_shared")
    if mailbox:
        assert front.transport == "gather" and front.stages().count("mailbox_publish") == 2
    fn, boxes = rank_call(sharded, mesh, backend, mailbox, plan=True)
    assert_matches(front, traced_kernel_steps(fn, x, sharded, boxes))


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_sharded_plan_is_what_runs(backend):
    mesh = jax.make_mesh((2, 2), ("data", "tp"), devices=jax.devices()[:4])
    sharded = mf.shard_params(mf.init_weights(jax.random.key(0), CFG), CFG, mesh)
    x = rows(6)
    front = mf.explain(x, sharded, backend=backend, plan=True, permute=True)
    assert (front.path, front.batch, front.groups) == ("sharded", 3, 2)
    assert front.check_vma == (backend == "xla")
    # Each data group routes its rows; the dispatch of all of them is sorted after the shard_map.
    assert "permute" not in front.stages()
    assert [(s.stage, s.kernel) for s in front.after] == [("permute", False)]
    found = traced_kernel_steps(partial(mf.moe_front, backend=backend, plan=True, permute=True),
                                x, sharded)
    assert_matches(front, found)


@pytest.mark.parametrize("backend", ["pallas", "auto"])
@pytest.mark.parametrize("options", ONE_DEVICE[:3], ids=str)
def test_one_device_plan_is_what_lowers_for_an_h200(backend, options):
    params, x = params_of(CFG), rows(8)
    front = explain_for_h200(x, params, backend=backend, **options)
    assert front.platform == "cuda" and front.device_kind == "NVIDIA H200"
    assert front.merged == (backend == "pallas")
    found = lowered_kernel_steps(partial(mf.moe_front, backend=backend, **options), x, params)
    assert_matches(front, found)


def test_mailbox_plan_is_what_lowers_for_an_h200():
    """Without a shared expert and with the plan, the tp1 mailbox path on "pallas" is Pallas
    kernels only: the GEMM publishing from its epilogue, then the routing kernel that polls. (The
    jax-triton publish and collect, which "auto" runs here, need a GPU jaxlib to lower.)"""
    params, x = params_of(NO_SHARED), rows(8)
    box = mf.Mailbox.create(NO_SHARED, capacity=8)
    front = explain_for_h200(x, params, backend="pallas", plan=True, mailbox=box)
    assert front.stages() == ("front_gemm_publish", "route_collect")
    found = lowered_kernel_steps(
        lambda x, p, b: mf.moe_front(x, p, backend="pallas", plan=True, mailbox=b)[0],
        x, params, box)
    assert_matches(front, found)
    auto = explain_for_h200(x, params, plan=True, mailbox=box)
    assert [(s.stage, s.kernel) for s in auto.steps] == [
        ("front_gemm", False), ("mailbox_publish", True), ("route_collect", True)]


@pytest.mark.parametrize("tp", [1, 2])
def test_publish_and_collect_are_plans(tp):
    """``mailbox.publish`` and ``collect`` run their plans' steps: on an H200 the jax-triton kernels
    where they cover the call (the publish only at tp = 1), else the reference with the rule."""
    cfg = CFG.with_tp(tp)
    box = mf.Mailbox.create(cfg, capacity=8)
    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        publish = planner.publish_plan(box, 4, 0, backend="pallas")
        collect = planner.collect_plan(box, 4, backend="pallas")
    assert [(s.stage, s.kernel) for s in publish.steps] == [("mailbox_publish", tp == 1)]
    if tp > 1:
        assert publish.steps[0].why.startswith("the kernel does not cover this: the jax-triton")
    assert [(s.stage, s.kernel) for s in collect.steps] == [("mailbox_collect", True)]
    logits = jnp.zeros((4, cfg.experts_per_rank), jnp.float32)
    latent = jnp.zeros((4, cfg.latent_per_rank), jnp.bfloat16)
    for fn, scope in [(lambda b: mb.publish(b, logits, latent, backend="xla").buffer,
                       "plan_step1_mailbox_publish"),
                      (lambda b: mb.collect(b, 4, backend="xla")[0], "plan_step1_mailbox_collect")]:
        assert scope in jax.jit(fn).lower(box).as_text(debug_info=True)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_kimi_k3_auto_plan_is_what_lowers_for_an_h200(batch):
    """At Kimi-K3's shapes "auto" follows the H200's measured tables: what the plan says runs as
    a kernel is what lowers as one."""
    cfg = mf.KIMI_K3
    params = jax.eval_shape(lambda: mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg))
    x = jax.ShapeDtypeStruct((batch, cfg.hidden), jnp.bfloat16)
    front = explain_for_h200(x, params, plan=True)
    assert front.stages()[-1] == "shared_expert" and "route" in front.stages()
    for step in front.steps:  # a kernel of several schedules names the one its table chose
        if step.kernel and step.stage in ("front_gemm", "front_gemm_plan", "shared_expert"):
            assert re.search(r"; \S+.* \((NVIDIA H200 table|heuristic)", step.why), step.why
    found = lowered_kernel_steps(partial(mf.moe_front, plan=True), x, params)
    assert_matches(front, found)


def test_the_table_names_every_step_and_its_rule():
    params, x = params_of(CFG), rows(3)
    text = str(mf.explain(x.shape, params, plan=True, backend="interpret"))
    assert text.splitlines()[0].startswith("moe_front plan: one device, B=3, backend='interpret'")
    for stage, schedule in (("front_gate_up", ""), ("route", "; mosaic_route \\(w1s1c3u1; .*"),
                            ("shared_down", "")):
        assert re.search(rf"^\d+\s+{stage}\s+pallas\.\S+ \(interpret\)\s+backend='interpret'"
                         rf"{schedule}$", text, re.M), text
    text = str(mf.explain(x, params, plan=True))
    assert "auto on cpu" in text and "reference.gemm.front_gemm" in text
    assert "note: merged front: no (front_gate_up: auto on cpu" in text


def test_explain_checks_its_arguments():
    params = params_of(CFG)
    with pytest.raises(ValueError, match=r"x must have shape \[B, hidden=256\]"):
        mf.explain((3, 128), params)
    with pytest.raises(ValueError, match="backend must be one of"):
        mf.explain((3, 256), params, backend="cuda")
    with pytest.raises(ValueError, match="mailbox was created for"):
        mf.explain((3, 256), params, mailbox=mf.Mailbox.create(NO_SHARED))


def test_explain_refuses_what_moe_front_refuses(monkeypatch):
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    weights = mf.init_weights(jax.random.key(0), CFG)
    sharded = mf.shard_params(weights, CFG, mesh)
    with pytest.raises(NotImplementedError, match="each rank needs its own mailbox"):
        mf.explain((4, 256), sharded, mailbox=True)
    rank = mf.pack_params(weights, CFG.with_tp(2), rank=0)
    with pytest.raises(ValueError, match="params are one rank's shard of tp=2"):
        mf.explain((4, 256), rank)
    odd = dataclasses.replace(CFG, hidden=255, tp=2)
    odd_rank = mf.pack_params(mf.init_weights(jax.random.key(0), odd.with_tp(1)), odd, rank=0)
    with pytest.raises(ValueError, match="scatters hidden=255 over tp=2"):
        mf.explain((4, 255), odd_rank, axis_name="tp", shared_reduce="psum_scatter")
    # Peer stores across ranks (where the collect's GPU kernels run) need two generations.
    monkeypatch.setattr(registry, "on_gpu", lambda: True)
    one = mf.Mailbox.create(rank.cfg, capacity=8, generations=1)
    with pytest.raises(ValueError, match="needs generations >= 2"):
        mf.explain((4, 256), rank, axis_name="tp", mailbox=one)
    front = mf.explain((4, 256), rank, axis_name="tp", mailbox=mf.Mailbox.create(rank.cfg, 8))
    assert front.transport == "peer" and "mailbox_peer_publish" in front.stages()
