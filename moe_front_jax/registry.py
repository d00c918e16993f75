"""The stage table: each stage's reference, kernel and ``auto`` rule, and ``choose``, which says what
runs one stage under a backend and why. ``moe_front_jax.planner`` asks it step by step.

Every implementation of a stage takes the same arguments. The backends: ``"xla"`` runs the
reference; ``"pallas"`` the kernel (a GPU is needed); ``"interpret"`` the kernel in Pallas' interpret
mode (the mailbox's jax-triton kernels have none: the reference); ``"auto"`` the kernel on a GPU
where the stage's ``auto`` rule prefers it, else the reference. As in tokamax, a kernel raises
``NotImplementedError`` for a valid request it does not cover: ``"auto"`` falls through to the
reference, ``"pallas"`` and ``"interpret"`` pass the error on (the planner then runs the reference
and says why). ``ValueError`` is for bad input only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import NamedTuple

import jax

from moe_front_jax.pallas import device

BACKENDS = ("auto", "xla", "pallas", "interpret")
ALWAYS, NEVER = "always", "never"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: ``"module:function"`` paths, imported when first asked for.

    Attributes:
      reference: the plain-JAX implementation.
      kernel: the kernel, taking the reference's arguments and a keyword ``interpret``; it raises
        ``NotImplementedError`` for a valid request it does not cover.
      auto: where ``"auto"`` prefers the kernel on a GPU: ``ALWAYS``, ``NEVER``, or a predicate over
        the stage's arguments (a device's measured table, ``pallas/tuning/<device>/auto.json``).
      interprets: whether the kernel has Pallas' interpret mode (``"interpret"`` runs it there).
      covers: optional predicate over the arguments that raises ``NotImplementedError`` where the
        kernel does not cover them, without running it (so a caller can choose a path first).
      selects: optional function of the arguments that names the kernel's implementation and
        schedule, and why (a ``gemm.schedule.Selection``), for a stage of several.
    """

    reference: str
    kernel: str
    auto: str = ALWAYS
    interprets: bool = True
    covers: str | None = None
    selects: str | None = None


_P = "moe_front_jax.pallas"
_R = "moe_front_jax.reference"
STAGES: dict[str, Stage] = {
    "front_gemm": Stage(f"{_R}.gemm:front_gemm", f"{_P}.front_gemm:front_gemm",
                        auto=f"{_P}.front_gemm:auto_prefers_kernel",
                        covers=f"{_P}.front_gemm:covers", selects=f"{_P}.front_gemm:selects"),
    # The plan from the GEMM's epilogue was never timed against XLA's GEMM followed by the plan
    # kernel as one, so "auto" runs the plain GEMM and the plan stage.
    "front_gemm_plan": Stage(f"{_R}.gemm:front_gemm_plan", f"{_P}.front_gemm:front_gemm_plan",
                             auto=NEVER, covers=f"{_P}.front_gemm:covers",
                             selects=f"{_P}.front_gemm:selects"),
    # The Mosaic GPU routing kernel or the Triton one, per ``pallas/route/stage.py``'s measured rule.
    # With ``permute=True`` (a keyword) routing also writes the dispatch order (SPEC 4.1): the Triton
    # kernel in its launch, the Mosaic one in a second; "permute" is that order alone from ids (after
    # ``route_collect``).
    "route": Stage(f"{_R}.routing:route", f"{_P}.route.stage:route",
                   covers=f"{_P}.route.stage:covers", selects=f"{_P}.route.stage:selects"),
    "permute": Stage(f"{_R}.routing:permutation", f"{_P}.route:permutation",
                     covers=f"{_P}.route:covers_permutation"),
    "plan": Stage(f"{_R}.plan:mxfp8_plan", f"{_P}.plan:plan", covers=f"{_P}.plan:covers"),
    "shared_expert": Stage(f"{_R}.shared:shared_expert", f"{_P}.shared_expert:shared_expert",
                           auto=f"{_P}.shared_expert:auto_prefers_kernel",
                           covers=f"{_P}.shared_expert:covers",
                           selects=f"{_P}.shared_expert:selects"),
    # The merged front on the streaming engine: the front GEMM (with its plan) and the shared
    # expert's gate/up in one launch over [router; latent; gate; up], then the down. The plan takes
    # it where both kernels run and cover the call, else the stages above. "auto" never prefers it:
    # a tp1 layer measured slower with it than on the separate stages (docs/findings.md).
    "front_gate_up": Stage(f"{_R}.gemm:front_gate_up", f"{_P}.engine:front_gate_up", auto=NEVER,
                           covers=f"{_P}.engine:covers_front_gate_up"),
    "shared_down": Stage(f"{_R}.shared:shared_down", f"{_P}.engine:down", auto=NEVER,
                         covers=f"{_P}.engine:covers_down"),
    # The mailbox (SPEC section 7): publish, collect, the front GEMM publishing from its epilogue,
    # and the routing kernel that polls the mailbox itself (collect, route and plan in one launch).
    "mailbox_publish": Stage(f"{_R}.mailbox:publish", "moe_front_jax.bridge.triton_mailbox:publish",
                             interprets=False, covers="moe_front_jax.bridge.triton_mailbox:covers"),
    "mailbox_collect": Stage(f"{_R}.mailbox:collect", "moe_front_jax.bridge.triton_mailbox:collect",
                             interprets=False),
    "front_gemm_publish": Stage(f"{_R}.mailbox:gemm_publish", f"{_P}.front_gemm:front_gemm_publish",
                                auto=f"{_P}.front_gemm:auto_prefers_publish",
                                covers=f"{_P}.front_gemm:covers_publish",
                                selects=f"{_P}.front_gemm:selects_publish"),
    "route_collect": Stage(f"{_R}.mailbox:collect_route_plan", f"{_P}.route_collect:route_collect",
                           covers=f"{_P}.route_collect:covers"),
}


class Choice(NamedTuple):
    """What runs a stage: ``run`` takes the stage's arguments; ``kernel`` says whether it is the
    kernel (in interpret mode or not) rather than the reference; ``why`` is the rule that chose it;
    ``schedule`` names the kernel's implementation and schedule where the stage has several."""

    run: Callable
    kernel: bool
    why: str = ""
    schedule: str = ""


def check_backend(backend: str) -> str:
    """Validate ``backend``; returns it.

    Raises:
      ValueError: an unknown backend, or ``"pallas"`` where the target is not a GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "pallas" and not on_gpu():
        raise ValueError(
            f"backend='pallas' runs the Pallas kernels on an NVIDIA GPU, but JAX's platform is "
            f"{target_platform()!r}: use backend='interpret' for the same kernels in interpret mode, "
            "or 'xla' / 'auto' for the reference"
        )
    return backend


def target_platform() -> str:
    """The platform being compiled for: the abstract mesh's (ahead-of-time lowering), else JAX's
    default backend."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and getattr(abstract, "platform", None):
        return abstract.platform
    return jax.default_backend()


def on_gpu() -> bool:
    """Whether the target is an NVIDIA GPU."""
    return target_platform() in ("gpu", "cuda")


def choose(name: str, backend: str, *args, **kwargs) -> Choice:
    """What runs stage ``name`` under ``backend`` for these arguments (decided at trace time).

    Raises:
      ValueError: an unknown stage or backend.
      NotImplementedError: ``"pallas"`` or ``"interpret"`` asked of arguments the kernel does not
        cover (``"auto"`` falls through to the reference instead).
    """
    check_backend(backend)
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages are {tuple(STAGES)}")
    stage = STAGES[name]

    def reference(why: str) -> Choice:
        return Choice(load(stage.reference), False, why)

    if backend == "xla":
        return reference("backend='xla'")
    if backend == "interpret" and not stage.interprets:
        return reference("the kernel has no interpret mode")
    if backend == "auto":
        if not on_gpu():
            return reference(f"auto on {target_platform()}")
        if stage.auto == NEVER:
            return reference("auto never prefers this kernel (registry.STAGES)")
        if stage.auto != ALWAYS and not load(stage.auto)(*args, **kwargs):
            table = f"pallas/tuning/{device.kind_folder(device.device_kind())}/auto.json"
            return reference(f"auto: {table} does not have the kernel faster here")
        try:
            _covers(stage, *args, **kwargs)
        except NotImplementedError as error:
            return reference(f"the kernel does not cover this: {error}")
        why = "auto: always" if stage.auto == ALWAYS else "auto: measured faster (auto table)"
    else:
        _covers(stage, *args, **kwargs)
        why = f"backend={backend!r}"
    kernel = load(stage.kernel)
    if stage.interprets:
        kernel = functools.partial(kernel, interpret=backend == "interpret")
    schedule = ""
    if stage.selects is not None:
        selection = load(stage.selects)(*args, **kwargs)
        schedule = f"{selection.implementation} ({selection.reason})"
    return Choice(kernel, True, why, schedule)


def run(name: str, backend: str, *args, **kwargs):
    """Run stage ``name`` under ``backend``: ``choose(name, backend, *args, **kwargs).run(*args,
    **kwargs)``."""
    return choose(name, backend, *args, **kwargs).run(*args, **kwargs)


def _covers(stage: Stage, *args, **kwargs) -> None:
    if stage.covers is not None:
        load(stage.covers)(*args, **kwargs)


@functools.cache
def load(target: str) -> Callable:
    """The function a ``"module:function"`` path names, imported when first asked for."""
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)
