"""The public entry points: ``moe_front`` (the whole front of one decode step) and ``route``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax import parallel, planner, registry
from moe_front_jax import mailbox as mailboxes
from moe_front_jax.config import FrontConfig
from moe_front_jax.params import FrontParams, check_param_arrays


_MAILBOX_TP = (
    "mailbox= with shard_params' sharded params is not supported: each rank needs its own mailbox. "
    "Call moe_front inside your own jax.shard_map with axis_name= and this rank's Mailbox (created "
    "for the rank's cfg), or without a mailbox (the ranks then exchange through one all-gather)."
)


class Dispatch(NamedTuple):
    """The dispatch order of SPEC section 4.1, what grouped GEMMs over the routed experts consume (a
    pytree). Slot ``s = token * K + rank`` is token ``s // K``'s rank ``s % K``.

    Attributes:
      order: ``[B * K]`` int32 slots sorted by expert, by token within an expert (the stable sort by
        expert of ``ids.ravel()``); row ``j`` of the permuted input is token ``order[j] // K``.
      group_sizes: ``[E]`` int32 slots per expert (the histogram of ``ids``), summing to ``B * K``:
        ``jax.lax.ragged_dot``'s ``group_sizes``.
      inverse: ``[B * K]`` int32 position of each slot in ``order`` (``order[inverse] == arange``):
        slot ``s``'s expert output is row ``inverse[s]``. README.md ("A whole MoE layer") shows
        the grouped GEMMs and the combine.
    """

    order: jax.Array
    group_sizes: jax.Array
    inverse: jax.Array


class FrontOutput(NamedTuple):
    """What one call of ``moe_front`` returns (a pytree).

    Attributes:
      ids: ``[B, K]`` int32 chosen experts, rank 0 the largest key.
      weights: ``[B, K]`` bfloat16 routing weights.
      latent: ``[B, L]`` bfloat16, every rank's latent shard in rank order; None at ``latent=0``.
      logits: ``[B, E]`` float32 router logits of every expert.
      shared: ``[B, H]`` bfloat16 shared-expert output, or None without shared-expert weights; with
        ``shared_reduce="psum_scatter"`` split over the hidden size (``moe_front``'s docstring).
      plan: ``(values float8_e4m3fn [B, L], scales float8_e8m0fnu [B, L / 32])``, or None.
      status: int32 scalar: 0, or a mailbox timeout code.
      dispatch: ``Dispatch`` with ``permute=True``, else None; over every row of ``x``, with
        ``shard_params``' params on a mesh with data-parallel axes too.
    """

    ids: jax.Array
    weights: jax.Array
    latent: jax.Array
    logits: jax.Array
    shared: jax.Array | None
    plan: tuple[jax.Array, jax.Array] | None
    status: jax.Array
    dispatch: Dispatch | None = None


def check_batch(name: str, array, width_name: str, width: int, dtype) -> None:
    """``array`` must be a non-empty ``[B, width]`` array of ``dtype`` (checked at trace time)."""
    shape = getattr(array, "shape", None)
    kind = jnp.dtype(dtype).name
    if shape is None:
        raise ValueError(f"{name} must be a [B, {width_name}={width}] {kind} array, got a "
                         f"{type(array).__name__}")
    if len(shape) != 2 or shape[1] != width:
        raise ValueError(f"{name} must have shape [B, {width_name}={width}], got {tuple(shape)}")
    if shape[0] == 0:
        raise ValueError(f"{name} is an empty batch (shape {tuple(shape)}); B must be >= 1")
    if array.dtype != dtype:
        raise ValueError(f"{name} must be {kind}, got {array.dtype}")


def check_rows(x, cfg: FrontConfig) -> None:
    """``x`` must be a non-empty ``[B, H]`` bfloat16 array (checked at trace time)."""
    check_batch("x", x, "hidden", cfg.hidden, jnp.bfloat16)


def check_static_bool(name: str, value, function: str) -> bool:
    """``value`` must be a Python (or numpy) bool, not traced: it chooses what is traced."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} is traced: under jax.jit pass it as a static argument, "
            f"jax.jit({function}, static_argnames=('{name}',))"
        )
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def as_dispatch(fields) -> Dispatch | None:
    """``Dispatch`` of the stages' ``(order, group_sizes, inverse)``, or None."""
    return None if fields is None else Dispatch(*fields)


def _front_output(fields: dict, cfg: FrontConfig) -> FrontOutput:
    """``FrontOutput`` of the plan's fields; a front without a latent has ``latent`` None."""
    out = FrontOutput(*(fields[name] for name in planner.FIELDS[:-1]),
                      as_dispatch(fields["dispatch"]))
    return out._replace(latent=None) if cfg.latent == 0 else out


def check_plan(plan: bool, cfg: FrontConfig) -> None:
    """``plan=True`` needs a latent: a front without one (``latent=0``) has no MXFP8 plan."""
    if plan and cfg.latent == 0:
        raise ValueError(
            "plan=True asks for the MXFP8 plan of the latent, but FrontConfig.latent is 0: a front "
            "without a latent has no plan; call with plan=False")


def check_params(params) -> None:
    """``params`` must be ``FrontParams`` whose arrays match its config (checked at trace time)."""
    if not isinstance(params, FrontParams):
        raise ValueError(
            f"params must be FrontParams (from pack_params or shard_params), got {type(params).__name__}"
        )
    check_param_arrays(params, 1, f" for tp={params.cfg.tp}")


def moe_front(
    x: jax.Array,
    params: FrontParams,
    *,
    plan: bool = False,
    permute: bool = False,
    backend: str = "auto",
    axis_name: str | None = None,
    shared_reduce: str = "psum",
    mailbox: mailboxes.Mailbox | None = None,
) -> FrontOutput | tuple[FrontOutput, mailboxes.Mailbox]:
    """The MoE front of one decode step: front GEMM, exact top-k routing, latent, shared expert.

    ``plan``, ``permute``, ``backend``, ``axis_name`` and ``shared_reduce`` choose what is traced:
    under ``jax.jit`` they are static (``jax.jit(moe_front, static_argnames=("plan", "permute",
    "backend", "axis_name", "shared_reduce"))``, or ``functools.partial`` them in).

    Args:
      x: ``[B, H]`` bfloat16 decode rows, ``B >= 1``.
      params: ``FrontParams`` from ``pack_params``, or from ``shard_params`` (then the call runs under
        ``jax.shard_map`` over the params' mesh), or one rank's params with ``axis_name``.
      plan: also return the MXFP8 copy of the latent (``FrontOutput.plan``).
      permute: also return the dispatch order of SPEC section 4.1 (``FrontOutput.dispatch``):
        where the routing kernel runs, it writes the order in the same launch as the top-k.
      backend: ``"auto"`` (on a GPU each stage's kernel where ``registry.STAGES`` prefers it, by
        measured tables; the reference elsewhere), ``"xla"`` (the reference), ``"pallas"`` (the
        kernels) or ``"interpret"`` (the Pallas kernels in interpret mode). ``mf.explain`` with
        the same arguments prints what runs and why.
      axis_name: inside the caller's own ``jax.shard_map``: the mesh axis of the ``params.cfg.tp``
        ranks, ``params`` being this rank's (with Pallas kernels that ``shard_map`` needs
        ``check_vma=False``). See ``moe_front_jax.parallel``.
      shared_reduce: how the ranks' shared-expert partial sums are reduced: ``"psum"`` (``shared``
        ``[B, H]`` on every rank) or ``"psum_scatter"`` (each rank's ``H/tp`` hidden columns).
      mailbox: a ``Mailbox``: the logits and latent shard travel through it (published, polled,
        copied out, re-armed; SPEC section 7) before routing. Donate it: ``jax.jit(moe_front,
        donate_argnames="mailbox")`` (a call outside ``jit`` donates it itself). Its path
        canonicalizes -0 logits and latent values to +0 (routing is unaffected:
        ``sigmoid(-0) == sigmoid(+0)``). With ``axis_name``, this rank's mailbox (created for
        ``params.cfg``).

    What runs is the call's plan (``moe_front_jax.planner``; docs/architecture.md describes every
    path): where the params hold a shared expert and the streaming engine's kernels run and cover
    the call (tp = 1), the front is merged: one launch over ``[router; latent; gate; up]``,
    routing, then the shared expert's down. Every path gives the reference's answers within the
    bounds of SPEC.md.

    Returns:
      ``FrontOutput(ids, weights, latent, logits, shared, plan, status, dispatch)``; with a
      mailbox, the pair ``(FrontOutput, Mailbox)``, ``status`` being 0 or ``Mailbox.TIMEOUT``.

    Raises:
      ValueError: at trace time, for a wrong shape or dtype of ``x`` or ``params``, an empty batch,
        an unknown backend or shared_reduce, an ``axis_name`` that disagrees with the params, or a
        mailbox laid out for another config or too small for the batch.
      NotImplementedError: a mailbox with ``shard_params``' sharded params (each rank needs its own:
        call ``moe_front`` inside ``jax.shard_map`` with ``axis_name`` instead). Any ``B >= 1``
        runs on every backend: a stage whose kernel does not cover it runs its reference (SPEC
        section 9).

    Example::

      cfg = mf.KIMI_K3
      params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
      out = jax.jit(mf.moe_front)(x, params)      # x: [B, 7168] bfloat16
      out.ids, out.weights                         # [B, 16] int32, [B, 16] bfloat16
    """
    plan, permute = _check_call(x, params, plan, permute, backend, axis_name, shared_reduce,
                                mailbox, "moe_front")
    if axis_name is not None:
        parallel.check_rank(params, axis_name)
    options = dict(plan=plan, permute=permute, backend=backend, axis_name=axis_name,
                   shared_reduce=shared_reduce)
    if mailbox is None:
        return _front_output(_planned_front(x, params, None, **options), params.cfg)
    fields = _planned_front_donating(x, params, mailbox, **options)
    return _front_output(fields, params.cfg), mailboxes.with_arrays(mailbox, fields["buffer"],
                                                        fields["control"], fields["tickets"])


def _check_call(x, params, plan, permute, backend, axis_name, shared_reduce, mailbox,
                function: str) -> tuple[bool, bool]:
    """``moe_front``'s and ``explain``'s argument checks (those that need no ``shard_map``);
    returns ``(plan, permute)`` as bools."""
    plan = check_static_bool("plan", plan, function)
    permute = check_static_bool("permute", permute, function)
    registry.check_backend(backend)
    parallel.check_shared_reduce(shared_reduce)
    if axis_name is None and isinstance(params, FrontParams) and params.mesh is not None:
        if mailbox is not None:
            raise NotImplementedError(_MAILBOX_TP)
        parallel.check_sharded_params(params)
        check_rows(x, params.cfg)
        parallel.check_groups(x, params, shared_reduce)
    else:
        check_params(params)
        check_rows(x, params.cfg)
        if axis_name is None and params.cfg.tp != 1:
            raise ValueError(
                f"params are one rank's shard of tp={params.cfg.tp}; call moe_front inside "
                "jax.shard_map with axis_name=..., or pass the output of shard_params"
            )
        parallel.check_scatter(shared_reduce, params.cfg, params.cfg.tp)
        if mailbox is not None:
            mailboxes.check_mailbox(mailbox, params.cfg, x.shape[0])
    check_plan(plan, params.cfg)
    return plan, permute


def _planned_front(x, params: FrontParams, mailbox, **options) -> dict:
    """``front_plan`` for these arguments, run."""
    front = planner.front_plan(x.shape[0], params, mailbox=mailbox, **options)
    if options["axis_name"] is not None:
        parallel.check_vma_off(params, options["axis_name"], options["backend"],
                               front.runs_kernels)
    return planner.run_front(front, x, params, mailbox)


# With a mailbox the call is jitted with the mailbox donated, so that a call outside jit updates it
# in place (inside the caller's jit the caller donates it).
_planned_front_donating = functools.partial(
    jax.jit, static_argnames=("plan", "permute", "backend", "axis_name", "shared_reduce"),
    donate_argnames="mailbox")(_planned_front)


def explain(x, params: FrontParams, *, plan: bool = False, permute: bool = False,
            backend: str = "auto", axis_name: str | None = None, shared_reduce: str = "psum",
            mailbox=None) -> planner.FrontPlan:
    """What ``moe_front(x, params, ...)`` would run on this device, and why: its ``FrontPlan``.

    ``x`` is the rows (an array or ``jax.ShapeDtypeStruct``), or their shape ``(B, H)``; the other
    arguments are ``moe_front``'s (``mailbox`` a ``Mailbox``, or True for one of ``params.cfg``
    holding ``B`` rows). Print the result for a table of the steps: stage, implementation (a
    kernel, in interpret mode or not, the reference, or a collective) and the rule that chose it.

    Raises:
      ValueError, NotImplementedError: as ``moe_front`` (the checks that need no ``shard_map``).
    """
    if isinstance(x, tuple):
        x = jax.ShapeDtypeStruct(x, jnp.bfloat16)
    plan, permute = _check_call(x, params, plan, permute, backend, axis_name, shared_reduce,
                                None if mailbox is True else mailbox, "explain")
    if mailbox is True:
        if params.mesh is not None and axis_name is None:
            raise NotImplementedError(_MAILBOX_TP)
        mailbox = jax.eval_shape(lambda: mailboxes.Mailbox.create(params.cfg, x.shape[0]))
    front = planner.front_plan(x.shape[0], params, plan=plan, permute=permute, backend=backend,
                               axis_name=axis_name, shared_reduce=shared_reduce, mailbox=mailbox)
    return front


def route(
    logits: jax.Array,
    bias: jax.Array,
    cfg: FrontConfig,
    *,
    backend: str = "auto",
    permute: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, Dispatch]:
    """The routing step alone: exact top-k as ``cfg`` scores it (SPEC section 4: sigmoid + bias, its
    expert groups, 4.2, or softmax, 4.3).

    ``logits`` ``[B, E]`` float32 (``B >= 1``), ``bias`` ``[E]`` float32 (zeros for a router without
    one, as ``params.bias`` holds); ``backend`` as for ``moe_front``; ``permute`` (static under
    ``jax.jit``) also returns the ``Dispatch`` of SPEC section 4.1.

    Returns:
      ``ids`` ``[B, K]`` int32 (``cfg.top_k`` distinct experts in ``[0, E)`` for any input, ties
      to the lower id, NaN lowest) and ``weights`` ``[B, K]`` bfloat16; with ``permute``, the
      triple ``(ids, weights, Dispatch)``.

    Raises:
      ValueError: an unknown ``backend``, ``cfg`` not a ``FrontConfig``, ``logits`` or ``bias`` of
        the wrong shape or dtype, an empty batch, ``permute`` not a bool.
    """
    permute = check_static_bool("permute", permute, "route")
    registry.check_backend(backend)
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    check_batch("logits", logits, "experts", cfg.experts, jnp.float32)
    bias_shape = getattr(bias, "shape", None)
    if bias_shape is None or tuple(bias_shape) != (cfg.experts,) or bias.dtype != jnp.float32:
        got = (f"a {type(bias).__name__}" if bias_shape is None
               else f"{tuple(bias_shape)} {bias.dtype}")
        raise ValueError(f"bias must be ({cfg.experts},) float32, got {got}")
    routing = planner.route_plan(logits.shape[0], cfg, backend=backend, permute=permute)
    fields = planner.outputs(planner.run(routing, dict(logits=logits, bias=bias)))
    ids, weights = fields["ids"], fields["weights"]
    return (ids, weights) if not permute else (ids, weights, as_dispatch(fields["dispatch"]))
