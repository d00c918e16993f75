"""The Lamport mailbox's state (``Mailbox``) and one step through it: publish, collect, route.

A mailbox row per token carries every tensor-parallel rank's logits and latent shard (SPEC section 7;
the layout and the plain-JAX protocol are ``moe_front_jax.reference.mailbox``). What runs each step
(the jax-triton publish and collect, the front GEMM publishing from its epilogue, the routing kernel
polling the rows itself, the peer-store publish across GPUs, or the plain-JAX protocol) is the plan's
(``moe_front_jax.planner``'s ``exchange_plan``, ``publish_plan`` and ``collect_plan``); this module
holds the state and checks the arguments.

Why the immediate re-arm never erases a later step's value: on one device publish(t), collect(t) and
publish(t+1) are kernels on one stream, and jax-triton's kernels never trigger programmatic dependent
launch, so collect(t)'s re-arm is complete before publish(t+1) starts. Across ranks, rank ``r``
writes generation ``g`` of rank ``s`` again only at step ``t + G``, after its collect(t+G-1) saw
``s``'s publish(t+G-1), which ``s`` issued after its collect(t) re-armed step ``t``: safe for
``G >= 2``. The default ``G = 3`` (as TensorRT-LLM's Lamport buffers) leaves a step of slack.

``Mailbox.tickets`` keeps the front GEMM kernel's split-K tile counters from call to call (each call
leaves them zero), so no zeroing kernel runs before the GEMM. Polling is bounded: a chunk that still
holds the sentinel after the spin limit is a timeout, the status says ``TIMEOUT`` and the rows are
re-armed anyway; a caller that sees it should replace the mailbox, since a late writer may still land.

Cost: a publish writes ``4 B (L/2 + E) / tp`` bytes per rank; a collect reads ``4 B (L/2 + E)``,
writes as many out and as many again to re-arm, ``12 B (L/2 + E)`` moved: 2.1 MB, 0.6 us at B = 64
for Kimi-K3 at the H200's copy ceiling; at decode sizes the kernels cost their launch.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_front_jax import planner
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.front_gemm import ticket_count
from moe_front_jax.reference.mailbox import CONTROL_WORDS, TIMEOUT, armed_row, row_words

TRANSPORTS = ("gather", "peer")
"""How ``exchange`` carries the shards to every rank: ``"gather"``, one XLA all-gather and a local
publish of every rank's shard; ``"peer"``, each rank stores its words straight into every rank's
mailbox (``bridge.peer_mailbox``, GPU only)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mailbox:
    """A Lamport mailbox: state passed into ``moe_front`` and returned by it (a pytree).

    Donate it (``jax.jit(..., donate_argnames="mailbox")``) so that its buffer is updated in place;
    ``moe_front`` called outside ``jit`` donates it itself.

    Attributes:
      buffer: ``[generations, capacity, words]`` uint32 rows (layout: ``reference.mailbox``).
      control: ``[2]`` int32: the generation the last collect read, and the one the last publish
        wrote (``[G - 1, G - 1]`` when new).
      tickets: int32, zero between calls: the tile counters of the split-K and stream-K schedules
        of the front GEMM publishing into the mailbox (module docstring).
      cfg: the model config the rows are laid out for (static).
    """

    buffer: jax.Array
    control: jax.Array
    tickets: jax.Array
    cfg: FrontConfig = dataclasses.field(metadata=dict(static=True))

    TIMEOUT: ClassVar[int] = TIMEOUT
    """The status of a step that timed out (``FrontOutput.status``)."""

    @classmethod
    def create(cls, cfg: FrontConfig, capacity: int = 256, generations: int = 3) -> Mailbox:
        """An armed mailbox for up to ``capacity`` rows per call.

        Args:
          cfg: the model config; ``cfg.latent / cfg.tp`` must be even (a rank's shard fills whole
            words).
          capacity: the largest batch a call may carry.
          generations: buffers rotated from step to step (at least 2 across ranks, see the module
            docstring).

        Returns:
          A ``Mailbox`` whose every data word holds the sentinel, on the default device.

        Raises:
          ValueError: naming the argument, for a wrong type or value.
        """
        if not isinstance(cfg, FrontConfig):
            raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
        if cfg.latent_per_rank % 2:
            raise ValueError(
                f"cfg.latent / cfg.tp = {cfg.latent_per_rank} must be even: the mailbox packs "
                "bfloat16 latent columns in pairs into 32-bit words"
            )
        for name, value in (("capacity", capacity), ("generations", generations)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        rows = np.broadcast_to(armed_row(cfg), (generations, int(capacity), row_words(cfg)))
        control = jnp.full((CONTROL_WORDS,), int(generations) - 1, jnp.int32)
        tickets = jnp.zeros((ticket_count(cfg.experts_per_rank, cfg.latent_per_rank),), jnp.int32)
        return cls(jnp.asarray(rows), control, tickets, cfg)

    @property
    def generations(self) -> int:
        return self.buffer.shape[0]

    @property
    def capacity(self) -> int:
        return self.buffer.shape[1]

    @property
    def words(self) -> int:
        return self.buffer.shape[2]


def check_mailbox(mailbox, cfg: FrontConfig, batch: int) -> None:
    """``mailbox`` must be a ``Mailbox`` laid out for ``cfg`` with room for ``batch`` rows (trace time).

    Raises:
      ValueError: naming the argument, its value and what was expected.
    """
    if mailbox_config(mailbox) != cfg:
        raise ValueError(f"mailbox was created for {mailbox.cfg}, but the params are for {cfg}")
    arrays = (mailbox.buffer, mailbox.control, mailbox.tickets)
    if any(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.is_deleted()
           for a in arrays):
        raise ValueError(
            "mailbox's arrays were deleted: an earlier call donated them (moe_front outside jit, "
            "or a jit with donate_argnames='mailbox'); pass the Mailbox that call returned"
        )
    shape, dtype = tuple(mailbox.buffer.shape), mailbox.buffer.dtype
    if len(shape) != 3 or shape[2] != row_words(cfg) or dtype != jnp.uint32:
        raise ValueError(
            f"mailbox.buffer is {shape} {dtype}, expected (generations, capacity, "
            f"{row_words(cfg)}) uint32"
        )
    control = mailbox.control
    if tuple(control.shape) != (CONTROL_WORDS,) or control.dtype != jnp.int32:
        raise ValueError(
            f"mailbox.control is {tuple(control.shape)} {control.dtype}, "
            f"expected ({CONTROL_WORDS},) int32"
        )
    tickets = mailbox.tickets
    count = ticket_count(cfg.experts_per_rank, cfg.latent_per_rank)
    if tuple(tickets.shape) != (count,) or tickets.dtype != jnp.int32:
        raise ValueError(
            f"mailbox.tickets is {tuple(tickets.shape)} {tickets.dtype}, expected ({count},) int32"
        )
    if batch > mailbox.capacity:
        raise ValueError(
            f"batch of {batch} rows is over the mailbox capacity {mailbox.capacity}; create the "
            f"mailbox with Mailbox.create(cfg, capacity>={batch})"
        )


def mailbox_config(mailbox) -> FrontConfig:
    """The config ``mailbox`` is laid out for; a ValueError when it is not a ``Mailbox``."""
    if not isinstance(mailbox, Mailbox):
        raise ValueError(f"mailbox must be a Mailbox (Mailbox.create), got {type(mailbox).__name__}")
    return mailbox.cfg


def _check_shard(name: str, array, batch: int | None, width: int, dtype) -> int:
    shape = getattr(array, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] != width or array.dtype != dtype:
        got = shape if shape is None else f"{tuple(shape)} {array.dtype}"
        raise ValueError(f"{name} must be [B, {width}] {jnp.dtype(dtype)}, got {got}")
    if shape[0] == 0 or (batch is not None and shape[0] != batch):
        expected = "B >= 1" if batch is None else f"B = {batch} as logits"
        raise ValueError(f"{name} has {shape[0]} rows, expected {expected}")
    return shape[0]


def with_arrays(mailbox: Mailbox, buffer, control, tickets=None) -> Mailbox:
    """``mailbox`` holding these arrays (its ``tickets`` where None)."""
    tickets = mailbox.tickets if tickets is None else tickets
    return dataclasses.replace(mailbox, buffer=buffer, control=control, tickets=tickets)


def publish(
    mailbox: Mailbox,
    logits: jax.Array,
    latent_shard: jax.Array,
    rank: int | jax.Array = 0,
    *,
    backend: str = "auto",
) -> Mailbox:
    """Rank ``rank`` writes its ``logits`` ``[B, E/tp]`` float32 and ``latent_shard`` ``[B, L/tp]``
    bfloat16 into the next generation's rows.

    ``rank`` is an int in ``[0, tp)`` or an int32 scalar array (``lax.axis_index`` under
    ``shard_map``); ``backend`` as for ``moe_front`` (the jax-triton kernel publishes one device's
    rows, tp = 1; at tp > 1 the reference publishes, under every backend, and across GPUs
    ``exchange``'s ``"peer"`` stores into every rank's mailbox). Returns the mailbox with rows
    ``[0, B)`` of generation ``(control[0] + 1) mod G`` holding the canonical words at the rank's
    columns, and ``control[1]`` that generation.

    Raises:
      ValueError: a wrong shape or dtype, a batch over the capacity, or an int ``rank`` out of range.
    """
    cfg = mailbox_config(mailbox)
    batch = _check_shard("logits", logits, None, cfg.experts_per_rank, jnp.float32)
    _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
    check_mailbox(mailbox, cfg, batch)
    if isinstance(rank, int) and not 0 <= rank < cfg.tp:
        raise ValueError(f"rank must be in [0, tp={cfg.tp}), got {rank}")
    traced = not isinstance(rank, int)
    step = planner.publish_plan(mailbox, batch, None if traced else rank, backend=backend)
    ranks = dict(rank=rank) if traced else {}
    env = _run(step, mailbox, logits_shard=logits, latent_shard=latent_shard, **ranks)
    return with_arrays(mailbox, env["buffer"], env["control"])


def collect(
    mailbox: Mailbox, batch: int, *, backend: str = "auto"
) -> tuple[jax.Array, jax.Array, jax.Array, Mailbox]:
    """Read rows ``[0, batch)`` of the generation last published, and re-arm them.

    Args:
      mailbox: the ``Mailbox``.
      batch: rows to collect, in ``[1, capacity]``.
      backend: as for ``moe_front``.

    Returns:
      ``(logits [batch, E] float32, latent [batch, L] bfloat16, status int32 scalar, mailbox)``:
      status is ``TIMEOUT`` when a chunk still held the sentinel (after the spin limit on the GPU),
      else 0; the returned mailbox is armed and its ``control[0]`` is the generation read.

    Raises:
      ValueError: a wrong mailbox, or ``batch`` not in ``[1, capacity]``.
    """
    cfg = mailbox_config(mailbox)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    check_mailbox(mailbox, cfg, batch)
    step = planner.collect_plan(mailbox, batch, backend=backend)
    env = _run(step, mailbox, status=jnp.zeros((), jnp.int32))
    return env["logits"], env["latent"], env["status"], with_arrays(mailbox, env["buffer"],
                                                                    env["control"])


def _check_exchange(mailbox, logits, latent_shard, axis_name, transport) -> int:
    """``exchange``'s argument checks; returns the batch."""
    cfg = mailbox_config(mailbox)
    batch = _check_shard("logits", logits, None, cfg.experts_per_rank, jnp.float32)
    _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
    check_mailbox(mailbox, cfg, batch)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if axis_name is None and cfg.tp != 1:
        raise ValueError(
            f"the mailbox is for tp={cfg.tp} ranks: pass axis_name, the mesh axis of the ranks"
        )
    if axis_name is not None and lax.axis_size(axis_name) != cfg.tp:
        raise ValueError(
            f"axis_name={axis_name!r} has {lax.axis_size(axis_name)} ranks, but the mailbox is "
            f"for tp={cfg.tp}"
        )
    return batch


@functools.partial(
    jax.jit, static_argnames=("axis_name", "backend", "transport"), donate_argnames="mailbox"
)
def exchange(
    mailbox: Mailbox,
    logits: jax.Array,
    latent_shard: jax.Array,
    *,
    axis_name: str | None = None,
    backend: str = "auto",
    transport: str = "gather",
) -> tuple[jax.Array, jax.Array, jax.Array, Mailbox]:
    """One step through the mailbox: every rank publishes its shard, then this rank collects.

    ``logits`` ``[B, E/tp]`` float32 and ``latent_shard`` ``[B, L/tp]`` bfloat16 are this rank's;
    ``axis_name`` the ranks' mesh axis inside ``shard_map`` (None for tp = 1); ``transport``
    ``"gather"`` or ``"peer"`` (``TRANSPORTS``). Jitted with the mailbox donated (inside the
    caller's ``jit`` the caller donates it). Returns ``(logits [B, E] float32, latent [B, L]
    bfloat16, status int32 scalar, mailbox)`` as ``collect`` returns them.

    Raises:
      ValueError: a wrong shape, dtype or mailbox, a batch over its capacity, tp > 1 without
        ``axis_name``, an ``axis_name`` whose size is not tp, an unknown ``transport``, or
        ``"peer"`` over tp > 1 with fewer than 2 generations.
      NotImplementedError: ``"peer"`` without the GPU kernels (``"gather"`` over tp > 1 publishes
        with the reference: the jax-triton publish is one device's).
    """
    batch = _check_exchange(mailbox, logits, latent_shard, axis_name, transport)
    step = planner.exchange_plan(mailbox, batch, backend=backend, transport=transport,
                                 axis_name=axis_name)
    env = _run(step, mailbox, logits_shard=logits, latent_shard=latent_shard)
    return env["logits"], env["latent"], env["status"], _returned(mailbox, env)


@functools.partial(
    jax.jit, static_argnames=("axis_name", "backend", "transport", "plan", "permute"),
    donate_argnames="mailbox",
)
def exchange_route(
    mailbox: Mailbox,
    logits: jax.Array,
    latent_shard: jax.Array,
    bias: jax.Array,
    *,
    axis_name: str | None = None,
    backend: str = "auto",
    transport: str = "gather",
    plan: bool = False,
    permute: bool = False,
) -> tuple:
    """``exchange``, then routing (SPEC section 4) over the collected logits, with ``plan`` the MXFP8
    plan of the collected latent (section 5), with ``permute`` the dispatch order (section 4.1).

    ``bias`` is ``[E]`` float32; the other arguments are ``exchange``'s. The plan
    (``planner.exchange_plan``) runs ``route_collect`` (collect, route and plan in one launch) where
    its kernel runs and the plan is asked for, else the collect, routing and plan stages: the same
    bits either way. Returns ``(ids [B, K] int32, weights [B, K] bfloat16, logits [B, E] float32,
    latent [B, L] bfloat16, plan, status, dispatch, mailbox)``: ``plan`` ``(values, scales)`` or
    None, ``dispatch`` ``(order, group_sizes, inverse)`` (``api.Dispatch``'s fields) or None.
    Raises as ``exchange``; a wrong bias is a ``ValueError``.
    """
    batch = _check_exchange(mailbox, logits, latent_shard, axis_name, transport)
    step = planner.exchange_plan(mailbox, batch, backend=backend, transport=transport,
                                 axis_name=axis_name, route=True, plan=plan, permute=permute)
    env = _run(step, mailbox, logits_shard=logits, latent_shard=latent_shard, bias=bias)
    return _routed(mailbox, env)


@functools.partial(
    jax.jit,
    static_argnames=("split", "valid", "backend", "plan", "plan_block", "permute"),
    donate_argnames="mailbox",
)
def gemm_exchange_route(
    mailbox: Mailbox,
    x: jax.Array,
    packed: jax.Array,
    bias: jax.Array,
    *,
    split: int,
    valid: int,
    backend: str = "auto",
    plan: bool = False,
    plan_block: int | None = None,
    permute: bool = False,
) -> tuple:
    """``exchange_route`` at tp = 1 with the publish done by the front GEMM's stage
    ``front_gemm_publish``: where its kernel runs, the logits and latent go from the GEMM's
    registers into the mailbox and no publish kernel runs.

    ``x``, ``packed``, ``split`` and ``valid`` are ``front_gemm``'s arguments; ``bias``,
    ``backend``, ``plan`` and ``permute`` as for ``exchange_route``; ``plan_block`` multiplies with
    ``front_gemm_plan``'s schedule for this block rather than ``front_gemm``'s (the one the direct
    path runs, so that both give the same bits). Returns as ``exchange_route``; raises
    ``ValueError`` for a wrong mailbox or shapes that disagree with it.
    """
    cfg = mailbox_config(mailbox)
    check_mailbox(mailbox, cfg, x.shape[0])
    step = planner.exchange_plan(mailbox, x.shape[0], backend=backend, transport="gather",
                                 axis_name=None, route=True, plan=plan, permute=permute,
                                 gemm=(split, valid), plan_block=plan_block)
    return _routed(mailbox, _run(step, mailbox, x=x, packed=packed, bias=bias))


def _run(step: planner.FrontPlan, mailbox: Mailbox, **arrays) -> dict:
    """Run ``step`` over the mailbox's arrays and ``arrays``."""
    env = dict(buffer=mailbox.buffer, control=mailbox.control, tickets=mailbox.tickets, **arrays)
    return planner.run(step, env)


def _returned(mailbox: Mailbox, env: dict) -> Mailbox:
    return with_arrays(mailbox, env["buffer"], env["control"], env["tickets"])


def _routed(mailbox: Mailbox, env: dict) -> tuple:
    """``exchange_route``'s outputs from the environment after its plan."""
    fields = planner.outputs(env)
    return (fields["ids"], fields["weights"], fields["logits"], fields["latent"], fields["plan"],
            fields["status"], fields["dispatch"], _returned(mailbox, env))
