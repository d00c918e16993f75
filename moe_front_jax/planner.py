"""The front's plan: what runs, decided once when a call is traced, and the one runner that runs it.

A ``FrontPlan`` is the ordered ``Step``s of one call: each a stage, the implementation that runs it
(``registry.choose``'s kernel or reference, or a collective) and why that one. The API modules check
their arguments, ask ``front_plan`` (or ``exchange_plan``, ``publish_plan``, ``collect_plan``,
``route_plan``) for the plan and hand it to ``run``; nothing else decides what runs. A plan is a
pure function of static facts: the shapes, the params' config and split, the options, the backend
and the target device (its platform and kind). Steps name their inputs and outputs in an
environment of arrays, so one runner serves every path: one device and one rank inside
``jax.shard_map``, each with or without a mailbox, and the sharded params' ``shard_map`` (the rank's
plan run on every device). ``mf.explain`` prints a plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from moe_front_jax import registry
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas import device
from moe_front_jax.params import FrontParams, param_specs
from moe_front_jax.reference import exchange

FIELDS = ("ids", "weights", "latent", "logits", "shared", "plan", "status", "dispatch")
"""``FrontOutput``'s fields, in order: the names ``run`` returns them under."""
DISPATCH = ("order", "group_sizes", "inverse")
PEER_PUBLISH = "moe_front_jax.bridge.peer_mailbox:publish"


class Ref(NamedTuple):
    """A step's argument read from the environment by name (other arguments are static)."""

    name: str


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One step: ``outputs = run(*args, **kwargs)``, ``args`` holding ``Ref``s and static values.

    Attributes:
      stage: the ``registry.STAGES`` name, or the collective (``exchange``, ``gather_shards``,
        ``reduce_shared``) or ``mailbox_peer_publish``.
      run: what runs it.
      args, kwargs: its arguments (``kwargs`` a tuple of pairs, static).
      outputs: the environment names its results are bound to (one name: the whole result).
      kernel: whether ``run`` is a kernel rather than the reference or a collective.
      why: the rule that chose ``run``, and where the kernel has several schedules, which one.
    """

    stage: str
    run: Callable
    args: tuple
    outputs: tuple[str, ...]
    kernel: bool
    why: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def scope(self, index: int) -> str:
        """The name scope the runner traces step ``index`` (from 1) under: the lowered HLO's op
        names carry it, so a test can tell which step each kernel call came from."""
        return f"plan_step{index}_{self.stage}"

    @property
    def implementation(self) -> str:
        """The dotted name of what runs (``"... (interpret)"`` for a kernel in interpret mode)."""
        run, interpret = self.run, False
        if isinstance(run, functools.partial):
            interpret = run.keywords.get("interpret", False)
            run = run.func
        name = f"{run.__module__}.{run.__qualname__}".removeprefix("moe_front_jax.")
        return name + (" (interpret)" if interpret else "")


@dataclasses.dataclass(frozen=True, eq=False)
class FrontPlan:
    """What one call runs, in order.

    Attributes:
      path: ``"one device"``, ``"one rank"`` (inside the caller's ``shard_map``), ``"sharded"``
        (the rank's steps on every device of ``mesh`` under ``jax.shard_map``), or for the mailbox's
        and routing's own entry points ``"mailbox"`` and ``"route"``.
      backend, platform, device_kind: what the plan was made for.
      batch: the rows one rank's steps see.
      steps: the steps, in order.
      notes: the decisions that are not one step's (the merged front, the transport).
      mesh, axis: the sharded path's mesh and tensor-parallel axis.
      groups: data-parallel groups of the sharded path (the product of the mesh's other axes).
      after: the sharded path's steps over the global outputs, after the ``shard_map``.
      shared_reduce: how ``shared``'s partial sums are reduced on the tensor-parallel paths.
    """

    path: str
    backend: str
    platform: str
    device_kind: str
    batch: int
    steps: tuple[Step, ...]
    notes: tuple[str, ...] = ()
    mesh: Any = None
    axis: str | None = None
    groups: int = 1
    shared_reduce: str = "psum"
    after: tuple[Step, ...] = ()

    @property
    def runs_kernels(self) -> bool:
        """Whether any step inside the ``shard_map`` (every step off the sharded path) runs a kernel,
        in interpret mode or not."""
        return any(step.kernel for step in self.steps)

    @property
    def check_vma(self) -> bool:
        """``jax.shard_map``'s ``check_vma`` for these steps: off where a kernel runs (a
        ``pallas_call``'s out_shape carries no varying-axes type)."""
        return not self.runs_kernels

    @property
    def merged(self) -> bool:
        """Whether the front runs merged with the shared expert's gate/up (``front_gate_up``)."""
        return any(step.stage == "front_gate_up" for step in self.steps)

    @property
    def transport(self) -> str | None:
        """How the shards reach the mailbox: ``"peer"`` (stores into every rank's), ``"gather"``
        (a local publish of every rank's shard, gathered at tp > 1), ``"epilogue"`` (the front
        GEMM's own stores, tp = 1), or None (no mailbox)."""
        stages = {step.stage for step in self.steps}
        if "mailbox_peer_publish" in stages:
            return "peer"
        if "front_gemm_publish" in stages:
            return "epilogue"
        return "gather" if "mailbox_publish" in stages else None

    def stages(self) -> tuple[str, ...]:
        """The stages, in order."""
        return tuple(step.stage for step in self.steps)

    def table(self) -> str:
        """The plan as a text table: one row a step (stage, implementation, why)."""
        head = (f"moe_front plan: {self.path}, B={self.batch}, backend={self.backend!r}, "
                f"{self.platform} ({self.device_kind})")
        if self.mesh is not None:
            head += f", shard_map over {self.axis!r} x {self.groups} data group(s)"
        rows = [("#", "stage", "runs", "why")]
        rows += [(str(i), s.stage, s.implementation, s.why)
                 for i, s in enumerate(self.steps + self.after, 1)]
        widths = [max(len(row[c]) for row in rows) for c in range(3)]
        lines = [head] + ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3]
                          for row in rows]
        return "\n".join(lines + [f"note: {note}" for note in self.notes])

    __str__ = table


def target() -> tuple[str, str]:
    """The platform and device kind being compiled for."""
    platform = registry.target_platform()
    return platform, (device.device_kind() if platform in ("gpu", "cuda") else platform)


class _Builder:
    """Collects the steps of a plan: ``add`` asks ``registry`` what runs each stage."""

    def __init__(self, backend: str, avals: dict[str, Any]):
        self.backend = backend
        self.avals = dict(avals)
        self.steps: list[Step] = []
        self.notes: list[str] = []

    def _values(self, args):
        return [self.avals[a.name] if isinstance(a, Ref) else a for a in args]

    def choose(self, stage: str, *args, **kwargs) -> registry.Choice:
        """``registry.choose`` over the avals; a kernel that does not cover them is the reference,
        under every backend (SPEC section 9)."""
        values = self._values(args)
        try:
            return registry.choose(stage, self.backend, *values, **kwargs)
        except NotImplementedError as error:
            reference = registry.choose(stage, "xla", *values, **kwargs)
            return reference._replace(why=f"the kernel does not cover this: {error}")

    def add(self, stage: str, args: tuple, outputs: tuple[str, ...], avals: tuple, **kwargs):
        choice = self.choose(stage, *args, **kwargs)
        self.put(stage, choice.run, args, outputs, avals, choice.kernel, _why(choice), **kwargs)

    def put(self, stage: str, run: Callable, args: tuple, outputs: tuple[str, ...], avals: tuple,
            kernel: bool, why: str, **kwargs):
        self.steps.append(Step(stage, run, tuple(args), tuple(outputs), kernel, why,
                               tuple(kwargs.items())))
        self.avals.update(zip(outputs, avals))


def _why(choice: registry.Choice) -> str:
    return f"{choice.why}; {choice.schedule}" if choice.schedule else choice.why


def _aval(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _front_avals(batch: int, cfg: FrontConfig, split: int, has_shared: bool,
                 mailbox=None) -> dict[str, Any]:
    """The avals of one rank's inputs (the rank's shard of each weight)."""
    avals = {
        "x": _aval((batch, cfg.hidden), jnp.bfloat16),
        "packed": _aval((split + cfg.latent_per_rank, cfg.hidden), jnp.bfloat16),
        "bias": _aval((cfg.experts,), jnp.float32),
    }
    if has_shared:
        avals["gate_up"] = _aval((2 * cfg.shared_per_rank, cfg.hidden), jnp.bfloat16)
        avals["down"] = _aval((cfg.hidden, cfg.shared_per_rank), jnp.bfloat16)
    if mailbox is not None:
        avals.update(_mailbox_avals(mailbox))
    return avals


def _mailbox_avals(mailbox) -> dict[str, Any]:
    return {name: _aval(getattr(mailbox, name).shape, getattr(mailbox, name).dtype)
            for name in ("buffer", "control", "tickets")}


def _logits_latent(batch: int, cfg: FrontConfig, whole: bool) -> tuple:
    experts, latent = (cfg.experts, cfg.latent) if whole else (cfg.experts_per_rank,
                                                                cfg.latent_per_rank)
    return _aval((batch, experts), jnp.float32), _aval((batch, latent), jnp.bfloat16)


def _plan_avals(batch: int, cfg: FrontConfig) -> tuple:
    return ((_aval((batch, cfg.latent), jnp.float8_e4m3fn),
             _aval((batch, cfg.latent // cfg.plan_block), jnp.float8_e8m0fnu)),)


def _route_avals(batch: int, cfg: FrontConfig, permute: bool) -> tuple:
    chosen = (_aval((batch, cfg.top_k), jnp.int32), _aval((batch, cfg.top_k), jnp.bfloat16))
    if not permute:
        return chosen
    slots = _aval((batch * cfg.top_k,), jnp.int32)
    return (*chosen, slots, _aval((cfg.experts,), jnp.int32), slots)


STATUS = _aval((), jnp.int32)


def _route(b: _Builder, batch: int, cfg: FrontConfig, permute: bool) -> None:
    """``route`` over the whole ``logits`` (with ``permute`` the dispatch order too)."""
    outputs = ("ids", "weights", *(DISPATCH if permute else ()))
    kwargs = dict(permute=True) if permute else {}
    b.add("route", (Ref("logits"), Ref("bias"), cfg), outputs, _route_avals(batch, cfg, permute),
          **kwargs)


def _plan_stage(b: _Builder, batch: int, cfg: FrontConfig) -> None:
    b.add("plan", (Ref("latent"), cfg.plan_block), ("plan",), _plan_avals(batch, cfg))


def _publish(b: _Builder, batch: int, cfg: FrontConfig, transport: str, axis_name: str | None,
             logits: str, latent: str) -> None:
    """Every rank's shard into this rank's mailbox rows. Peer stores over tp > 1 ranks need two
    generations or more (``moe_front_jax.mailbox``'s docstring says why): a ``ValueError``."""
    box = (Ref("buffer"), Ref("control"))
    box_avals = (b.avals["buffer"], b.avals["control"], STATUS)
    if transport == "peer":
        generations = b.avals["buffer"].shape[0]
        if cfg.tp > 1 and generations < 2:
            raise ValueError(
                f"transport='peer' over tp={cfg.tp} ranks needs generations >= 2 (a fast rank's "
                f"next step must land in another generation), got {generations}")
        collect = b.choose("mailbox_collect", *box, STATUS, batch, cfg)
        if not collect.kernel:
            raise NotImplementedError(
                f"transport='peer' stores through GPU peer pointers and needs the GPU kernels, got "
                f"backend={b.backend!r} on {registry.target_platform()}; use transport='gather'")
        b.put("mailbox_peer_publish", registry.load(PEER_PUBLISH),
              (*box, Ref(logits), Ref(latent), cfg, axis_name), ("buffer", "control", "status"),
              box_avals, True, "the collect's kernels run: the ranks store into every mailbox")
        return
    shards = [(logits, latent)]
    if cfg.tp > 1:
        names = tuple(f"{logits}_{r}" for r in range(cfg.tp)) + tuple(
            f"{latent}_{r}" for r in range(cfg.tp))
        rank_avals = _logits_latent(batch, cfg, whole=False)
        b.put("gather_shards", exchange.gather_shards, (Ref(logits), Ref(latent), axis_name), names,
              (rank_avals[0],) * cfg.tp + (rank_avals[1],) * cfg.tp, False, "the gather transport")
        shards = [(names[r], names[cfg.tp + r]) for r in range(cfg.tp)]
    for rank, (rank_logits, rank_latent) in enumerate(shards):
        b.add("mailbox_publish", (*box, Ref(rank_logits), Ref(rank_latent), rank, cfg),
              ("buffer", "control", "status"), box_avals)


def _collect(b: _Builder, batch: int, cfg: FrontConfig) -> None:
    """Rows ``[0, batch)`` of the generation last published, whole, and the mailbox re-armed."""
    b.add("mailbox_collect", (Ref("buffer"), Ref("control"), Ref("status"), batch, cfg),
          ("logits", "latent", "status", "buffer", "control"),
          (*_logits_latent(batch, cfg, whole=True), STATUS, b.avals["buffer"], b.avals["control"]))


def _route_published(b: _Builder, batch: int, cfg: FrontConfig, plan: bool, permute: bool) -> None:
    """After the publish: ``route_collect`` (then ``permute`` from its ids) where its kernel runs
    and the plan is asked for, else collect, route and plan."""
    args = (Ref("buffer"), Ref("control"), Ref("status"), Ref("bias"), batch, cfg)
    whole = _logits_latent(batch, cfg, whole=True)
    box_avals = (b.avals["buffer"], b.avals["control"])
    fused = b.choose("route_collect", *args, with_plan=True) if plan else None
    if fused is not None and fused.kernel:
        b.put("route_collect", fused.run, args,
              ("ids", "weights", "logits", "latent", "plan", "status", "buffer", "control"),
              (*_route_avals(batch, cfg, False), *whole, *_plan_avals(batch, cfg), STATUS,
               *box_avals), True, _why(fused), with_plan=True)
        if permute:
            b.add("permute", (Ref("ids"), cfg), DISPATCH, _route_avals(batch, cfg, True)[2:])
        return
    if fused is not None:
        b.notes.append(f"route_collect: {fused.why}")
    _collect(b, batch, cfg)
    _route(b, batch, cfg, permute)
    if plan:
        _plan_stage(b, batch, cfg)


def _one_device(b: _Builder, batch: int, cfg: FrontConfig, split: int, has_shared: bool, *,
                plan: bool, permute: bool, mailbox: bool) -> None:
    gemm = (Ref("x"), Ref("packed"), split, cfg.experts_per_rank)
    whole = _logits_latent(batch, cfg, whole=True)
    planned = _plan_avals(batch, cfg)
    hidden = _aval((batch, cfg.shared_per_rank), jnp.bfloat16)
    merged_plan = plan and not mailbox
    merged = False
    if has_shared:
        gate_up = b.choose("front_gate_up", *gemm, Ref("gate_up"), cfg, plan=merged_plan)
        down = b.choose("shared_down", hidden, Ref("down"), jnp.bfloat16)
        merged = gate_up.kernel and down.kernel
        if not merged:
            b.notes.append(f"merged front: no (front_gate_up: {gate_up.why}; shared_down: "
                           f"{down.why})")
    if merged:
        b.put("front_gate_up", gate_up.run, (*gemm, Ref("gate_up"), cfg),
              ("logits", "latent", "plan", "hidden"), (*whole, *planned, hidden), True,
              _why(gate_up), plan=merged_plan)
    plan_gemm = plan and not merged and b.choose("front_gemm_plan", *gemm, cfg.plan_block).kernel
    if mailbox:
        block = cfg.plan_block if plan_gemm else None
        box = (Ref("buffer"), Ref("control"), Ref("tickets"), cfg)
        publish = None if merged else b.choose("front_gemm_publish", *gemm, *box, plan_block=block)
        if publish is not None and publish.kernel:
            b.put("front_gemm_publish", publish.run, (*gemm, *box),
                  ("buffer", "control", "tickets", "status"),
                  (b.avals["buffer"], b.avals["control"], b.avals["tickets"], STATUS), True,
                  _why(publish), plan_block=block)
        else:
            if not merged:
                b.add("front_gemm", gemm, ("logits", "latent"), whole)
            _publish(b, batch, cfg, "gather", None, "logits", "latent")
        _route_published(b, batch, cfg, plan, permute)
    else:
        if plan_gemm:
            b.add("front_gemm_plan", (*gemm, cfg.plan_block), ("logits", "latent", "plan"),
                  (*whole, *planned))
        elif not merged:
            b.add("front_gemm", gemm, ("logits", "latent"), whole)
            if plan:
                _plan_stage(b, batch, cfg)
        _route(b, batch, cfg, permute)
    if merged:
        b.add("shared_down", (Ref("hidden"), Ref("down"), jnp.bfloat16), ("shared",),
              (_aval((batch, cfg.hidden), jnp.bfloat16),))
    elif has_shared:
        b.add("shared_expert", (Ref("x"), Ref("gate_up"), Ref("down"), cfg, jnp.bfloat16),
              ("shared",), (_aval((batch, cfg.hidden), jnp.bfloat16),))


def _one_rank(b: _Builder, batch: int, cfg: FrontConfig, split: int, has_shared: bool,
              axis_name: str, *, plan: bool, permute: bool, mailbox: bool,
              shared_reduce: str) -> None:
    """One rank inside ``shard_map``: its GEMM, the exchange, routing of all experts. The front
    stays unmerged: Mosaic GPU's interpret mode cannot run under a ``shard_map`` of several
    devices, so a merged front under tp could not be checked off the GPU."""
    gemm = (Ref("x"), Ref("packed"), split, cfg.experts_per_rank)
    b.add("front_gemm", gemm, ("logits_shard", "latent_shard"),
          _logits_latent(batch, cfg, whole=False))
    if mailbox:
        collect = b.choose("mailbox_collect", Ref("buffer"), Ref("control"), STATUS, batch, cfg)
        transport = "peer" if collect.kernel else "gather"
        b.notes.append(f"transport: {transport!r} (the collect: {collect.why})")
        _publish(b, batch, cfg, transport, axis_name, "logits_shard", "latent_shard")
        _route_published(b, batch, cfg, plan, permute)
    else:
        b.put("exchange", exchange.exchange, (Ref("logits_shard"), Ref("latent_shard"), axis_name),
              ("logits", "latent"), _logits_latent(batch, cfg, whole=True), False,
              "one all-gather of [latent | logits] rows")
        _route(b, batch, cfg, permute)
        if plan:
            _plan_stage(b, batch, cfg)
    if has_shared:
        b.add("shared_expert", (Ref("x"), Ref("gate_up"), Ref("down"), cfg, jnp.float32),
              ("partial",), (_aval((batch, cfg.hidden), jnp.float32),))
        scattered = cfg.hidden // cfg.tp if shared_reduce == "psum_scatter" else cfg.hidden
        b.put("reduce_shared", exchange.reduce_shared, (Ref("partial"), axis_name, shared_reduce),
              ("shared",), (_aval((batch, scattered), jnp.bfloat16),), False,
              f"shared_reduce={shared_reduce!r}")


def front_plan(batch: int, params: FrontParams, *, plan: bool = False, permute: bool = False,
               backend: str = "auto", axis_name: str | None = None, shared_reduce: str = "psum",
               mailbox=None) -> FrontPlan:
    """The plan of ``moe_front`` over ``batch`` rows of ``params`` (arguments checked by the caller).

    ``params`` from ``pack_params`` give the one-device path; one rank's params with ``axis_name``
    the one-rank path; ``shard_params``' params (``params.mesh``) the sharded path, whose steps are
    a rank's over ``batch / groups`` rows. ``mailbox`` is a ``Mailbox`` (or anything with its
    ``buffer``, ``control`` and ``tickets`` shapes), or None.
    """
    registry.check_backend(backend)
    cfg, split, has_shared = params.cfg, params.split, params.gate_up is not None
    options = dict(plan=plan, permute=permute, mailbox=mailbox is not None)
    platform, kind = target()
    if axis_name is None and params.mesh is not None:
        mesh, axis = params.mesh, params.axis
        groups = math.prod(mesh.shape[n] for n in mesh.axis_names if n != axis)
        rows = batch // groups
        b = _Builder(backend, _front_avals(rows, cfg, split, has_shared))
        # With data-parallel groups each group routes its own rows; the dispatch of every row is
        # the permutation of the global ids, after the shard_map, by the reference sort (a kernel
        # over a global array sharded over the groups is not tested).
        local = dict(options, permute=permute and groups == 1)
        _one_rank(b, rows, cfg, split, has_shared, axis, shared_reduce=shared_reduce, **local)
        after = _Builder("xla", dict(ids=_aval((batch, cfg.top_k), jnp.int32)))
        if permute and groups > 1:
            after.add("permute", (Ref("ids"), cfg), DISPATCH, _route_avals(batch, cfg, True)[2:])
            step = after.steps[0]
            after.steps[0] = dataclasses.replace(
                step, why=f"the global dispatch of {groups} data groups: the reference sort")
        return FrontPlan("sharded", backend, platform, kind, rows, tuple(b.steps), tuple(b.notes),
                         mesh, axis, groups, shared_reduce, tuple(after.steps))
    b = _Builder(backend, _front_avals(batch, cfg, split, has_shared, mailbox))
    if axis_name is not None:
        _one_rank(b, batch, cfg, split, has_shared, axis_name, shared_reduce=shared_reduce,
                  **options)
        path = "one rank"
    else:
        _one_device(b, batch, cfg, split, has_shared, **options)
        path = "one device"
    return FrontPlan(path, backend, platform, kind, batch, tuple(b.steps), tuple(b.notes),
                     axis=axis_name, shared_reduce=shared_reduce)


def exchange_plan(mailbox, batch: int, *, backend: str, transport: str, axis_name: str | None,
                  route: bool = False, plan: bool = False, permute: bool = False,
                  gemm: tuple[int, int] | None = None, plan_block: int | None = None) -> FrontPlan:
    """The plan of one step through ``mailbox`` (``moe_front_jax.mailbox``'s ``exchange``,
    ``exchange_route`` and, with ``gemm = (split, valid)``, ``gemm_exchange_route``): the publish
    (the front GEMM's, with ``gemm``), then the collect, or with ``route`` the routing of the
    collected rows (``plan``, ``permute`` as for ``moe_front``)."""
    cfg = mailbox.cfg
    b = _mailbox_builder(mailbox, batch, backend)
    if gemm is not None:
        split, valid = gemm
        b.avals.update(x=_aval((batch, cfg.hidden), jnp.bfloat16),
                       packed=_aval((split + cfg.latent_per_rank, cfg.hidden), jnp.bfloat16))
        b.add("front_gemm_publish", (Ref("x"), Ref("packed"), split, valid, Ref("buffer"),
                                     Ref("control"), Ref("tickets"), cfg),
              ("buffer", "control", "tickets", "status"),
              (b.avals["buffer"], b.avals["control"], b.avals["tickets"], STATUS),
              plan_block=plan_block)
    else:
        _publish(b, batch, cfg, transport, axis_name, "logits_shard", "latent_shard")
    if route:
        _route_published(b, batch, cfg, plan, permute)
    else:
        _collect(b, batch, cfg)
    return _mailbox_plan(b, batch, axis_name)


def publish_plan(mailbox, batch: int, rank, *, backend: str) -> FrontPlan:
    """The plan of ``mailbox.publish``: one rank's ``logits_shard`` and ``latent_shard`` into the
    next generation's rows. ``rank`` is an int, or None for a traced scalar bound as ``rank``."""
    b = _mailbox_builder(mailbox, batch, backend)
    b.avals["rank"] = STATUS
    box = (Ref("buffer"), Ref("control"))
    b.add("mailbox_publish", (*box, Ref("logits_shard"), Ref("latent_shard"),
                              Ref("rank") if rank is None else rank, mailbox.cfg),
          ("buffer", "control", "status"), (b.avals["buffer"], b.avals["control"], STATUS))
    return _mailbox_plan(b, batch, None)


def collect_plan(mailbox, batch: int, *, backend: str) -> FrontPlan:
    """The plan of ``mailbox.collect``: rows ``[0, batch)`` of the generation last published."""
    b = _mailbox_builder(mailbox, batch, backend)
    _collect(b, batch, mailbox.cfg)
    return _mailbox_plan(b, batch, None)


def _mailbox_builder(mailbox, batch: int, backend: str) -> _Builder:
    """A builder over the mailbox's arrays, one rank's shards of ``batch`` rows, the bias and the
    status."""
    cfg = mailbox.cfg
    avals = _mailbox_avals(mailbox)
    logits, latent = _logits_latent(batch, cfg, whole=False)
    avals.update(bias=_aval((cfg.experts,), jnp.float32), logits_shard=logits,
                 latent_shard=latent, status=STATUS)
    return _Builder(backend, avals)


def _mailbox_plan(b: _Builder, batch: int, axis_name: str | None) -> FrontPlan:
    platform, kind = target()
    return FrontPlan("mailbox", b.backend, platform, kind, batch, tuple(b.steps), tuple(b.notes),
                     axis=axis_name)


def route_plan(batch: int, cfg: FrontConfig, *, backend: str, permute: bool) -> FrontPlan:
    """The plan of ``route``: the routing stage alone."""
    b = _Builder(backend, dict(logits=_aval((batch, cfg.experts), jnp.float32),
                               bias=_aval((cfg.experts,), jnp.float32)))
    _route(b, batch, cfg, permute)
    platform, kind = target()
    return FrontPlan("route", backend, platform, kind, batch, tuple(b.steps))


def run(plan: FrontPlan, env: dict[str, Any], first: int = 1) -> dict[str, Any]:
    """Run ``plan``'s steps over ``env`` (name -> array), numbered from ``first`` in their name
    scopes; returns the environment after them."""
    env = dict(env)
    for index, step in enumerate(plan.steps, first):
        args = [env[a.name] if isinstance(a, Ref) else a for a in step.args]
        with jax.named_scope(step.scope(index)):
            result = step.run(*args, **dict(step.kwargs))
        if len(step.outputs) == 1:
            result = (result,)
        env.update(zip(step.outputs, result, strict=True))
    return env


def outputs(env: dict[str, Any]) -> dict[str, Any]:
    """``FrontOutput``'s fields from an environment after a front plan: ``dispatch`` the triple
    ``(order, group_sizes, inverse)`` or None, ``status`` 0 where nothing polled."""
    fields = {name: env.get(name) for name in FIELDS}
    if fields["status"] is None:
        fields["status"] = jnp.zeros((), jnp.int32)
    fields["dispatch"] = tuple(env[n] for n in DISPATCH) if "order" in env else None
    return fields


def run_front(plan: FrontPlan, x: jax.Array, params: FrontParams, mailbox=None) -> dict[str, Any]:
    """Run a front plan on ``x`` and ``params``: ``FrontOutput``'s fields, then (with a mailbox)
    the mailbox's ``buffer``, ``control`` and ``tickets`` under those names."""
    if plan.path == "sharded":
        return _run_sharded(plan, x, params)
    env = dict(x=x, packed=params.packed, bias=params.bias, gate_up=params.gate_up,
               down=params.down)
    if mailbox is not None:
        env.update(buffer=mailbox.buffer, control=mailbox.control, tickets=mailbox.tickets)
    env = run(plan, env)
    fields = outputs(env)
    if mailbox is not None:
        fields.update({name: env[name] for name in ("buffer", "control", "tickets")})
    return fields


def _run_sharded(plan: FrontPlan, x: jax.Array, params: FrontParams) -> dict[str, Any]:
    """The rank's steps on every device of the plan's mesh under ``jax.shard_map``; the mesh's
    other axes split the batch."""
    mesh, axis = plan.mesh, plan.axis
    others = tuple(name for name in mesh.axis_names if name != axis)
    batch = others or None
    rows = PartitionSpec(batch, None)
    explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
    if explicit:
        # shard_map takes x typed over Explicit axes only in its in_spec's sharding; over Auto axes
        # jit reshards x itself (and jax.reshard refuses them).
        split = tuple(name for name in others if name in explicit) or None
        x = jax.reshard(x, NamedSharding(mesh, PartitionSpec(split, None)))
    specs = param_specs(axis)
    shared = PartitionSpec(batch, axis) if plan.shared_reduce == "psum_scatter" else rows

    def body(x, packed, bias, gate_up, down):
        env = run(plan, dict(x=x, packed=packed, bias=bias, gate_up=gate_up, down=down))
        return tuple(outputs(env).values())

    front = jax.shard_map(
        body, mesh=mesh,
        in_specs=(rows, specs["packed"], specs["bias"], specs["gate_up"], specs["down"]),
        out_specs=(rows, rows, rows, rows, shared, rows, PartitionSpec(), PartitionSpec(batch)),
        check_vma=plan.check_vma,
    )
    fields = dict(zip(FIELDS, front(x, params.packed, params.bias, params.gate_up, params.down)))
    if plan.after:
        env = dict(fields)
        if explicit:  # a sort over the batch takes it whole, not split over Explicit data axes
            env["ids"] = jax.reshard(env["ids"], NamedSharding(mesh, PartitionSpec()))
        env = run(dataclasses.replace(plan, steps=plan.after, after=()), env,
                  first=len(plan.steps) + 1)
        fields["dispatch"] = tuple(env[name] for name in DISPATCH)
    return fields
