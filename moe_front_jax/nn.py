"""The MoE front as a Flax NNX module: ``mf.nn.MoEFront``.

The module holds the weights of SPEC.md section 2 as ``nnx.Param`` under the model's own module names
(``gate.weight``, ``gate.e_score_correction_bias``, ``routed_down_weight``,
``shared_experts.gate_up_proj.weight``, ``shared_experts.down_proj.weight``), so ``nnx.state(front)``
paths read like the checkpoint's keys. Each Param carries its tensor-parallel annotation
(``out_sharding``, a tuple naming the mesh axis on the dimension the weight is split along), which
``nnx.get_partition_spec`` turns into a ``PartitionSpec``. At call time the module packs the weights into
``FrontParams`` (inside ``jit`` that is one concatenation) and calls ``mf.moe_front``: on one device, or
with a ``mesh`` on every device under ``jax.shard_map``, each packing only its own rank's shard.

Example::

  import jax, jax.numpy as jnp
  from flax import nnx
  import moe_front_jax as mf

  front = mf.nn.MoEFront(mf.KIMI_K3, rngs=nnx.Rngs(0))
  out = nnx.jit(lambda m, x: m(x))(front, x)   # x: [B, 7168] bfloat16 -> FrontOutput

  mesh = jax.make_mesh((8,), ("tp",))
  front = mf.nn.MoEFront.from_checkpoint("/ckpt", mf.KIMI_K3, "model.layers.3.mlp.", mesh=mesh)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from moe_front_jax import checkpoint, parallel
from moe_front_jax import params as P
from moe_front_jax.api import FrontOutput, check_rows, moe_front
from moe_front_jax.backends import check_backend
from moe_front_jax.config import FrontConfig
from moe_front_jax.params import FrontParams

TP = "tp"
"""Name of the tensor-parallel mesh axis in the Params' sharding annotations."""


def param_shardings(axis: str = TP) -> dict[str, tuple[str | None, ...]]:
    """The tensor-parallel annotation of each module weight, in the module's layout.

    Router rows and latent rows split along experts and latent rows; the correction bias is whole on
    every rank (routing ranks all experts); the shared expert splits its intermediate ``S``. The fused
    gate/up weight is held as ``[2, S, H]`` (gate, then up): a rank's share is its block of the gate
    rows AND its block of the up rows, which only a split of the ``S`` axis of that view expresses.
    """
    return {
        P.GATE: (axis, None),
        P.BIAS: (None,),
        P.ROUTED_DOWN: (axis, None),
        P.GATE_UP: (None, axis, None),
        P.DOWN: (None, axis),
    }


def module_shape(name: str, cfg: FrontConfig) -> tuple[int, ...]:
    """Shape of weight ``name`` as the module holds it (``gate_up`` as ``[2, S, H]``)."""
    if name == P.GATE_UP:
        return (2, cfg.shared, cfg.hidden)
    return P.weight_shapes(cfg)[name][0]


class _Gate(nnx.Module):
    """The router: ``weight`` ``[E, H]`` bf16 and ``e_score_correction_bias`` ``[E]`` f32."""

    def __init__(self, weight: nnx.Param, e_score_correction_bias: nnx.Param):
        self.weight = weight
        self.e_score_correction_bias = e_score_correction_bias


class _Projection(nnx.Module):
    """One projection's ``weight``."""

    def __init__(self, weight: nnx.Param):
        self.weight = weight


class _SharedExperts(nnx.Module):
    """The shared expert: ``gate_up_proj.weight`` ``[2, S, H]`` and ``down_proj.weight`` ``[H, S]``."""

    def __init__(self, gate_up: nnx.Param, down: nnx.Param):
        self.gate_up_proj = _Projection(gate_up)
        self.down_proj = _Projection(down)


class MoEFront(nnx.Module):
    """The decode-time MoE front of one layer as an NNX module.

    On one device ``front(x)`` is ``mf.moe_front(x, mf.pack_params(front.weights(), cfg))``: the front
    GEMM, exact top-k routing, the latent and the shared expert of ``x`` ``[B, H]`` bfloat16. With a
    ``mesh``, every Param is a global array whose shards sit where its annotation says (rank ``r`` of
    ``axis`` holds its router rows, latent rows and shared-expert slice), and a call runs
    ``mf.moe_front(x, rank_params, axis_name=axis)`` on every device under ``jax.shard_map``; the mesh's
    other axes split the batch.

    Args:
      cfg: the model config; ``cfg.tp`` must be 1 without a mesh, and 1 or the size of ``axis`` with one.
      rngs: draw fresh weights with ``mf.init_weights`` from ``rngs.params()``; give this or
        ``weights``.
      weights: the weights under the keys of SPEC section 2 (``mf.init_weights``' or
        ``mf.load_weights``' output), validated against ``cfg``. ``MoEFront.from_checkpoint`` reads a
        checkpoint straight into the module (and into the shards).
      shared: with ``rngs``, also draw the shared expert's weights (needs ``cfg.shared > 0``). With
        ``weights`` the shared expert is there exactly when its keys are.
      backend: the backend ``moe_front`` runs (``"auto"``, ``"xla"``, ``"pallas"``, ``"interpret"``).
      mesh: a ``jax.sharding.Mesh`` with ``axis`` to shard the weights over, or None for one device.
      axis: the tensor-parallel mesh axis (the name in the Params' annotations).
      shared_reduce: with a mesh, how the ranks' shared-expert partial sums are reduced: ``"psum"``
        (``shared`` ``[B, H]`` whole) or ``"psum_scatter"`` (``[B, H]`` whose hidden columns are sharded
        over ``axis``, what a MoE tail consumes).

    Attributes:
      gate.weight: ``nnx.Param`` ``[E, H]`` bfloat16, annotated ``(axis, None)``.
      gate.e_score_correction_bias: ``nnx.Param`` ``[E]`` float32, annotated ``(None,)``.
      routed_down_weight: ``nnx.Param`` ``[L, H]`` bfloat16, annotated ``(axis, None)``.
      shared_experts.gate_up_proj.weight: ``nnx.Param`` ``[2, S, H]`` bfloat16 (the checkpoint's
        ``[2S, H]``, gate rows then up rows), annotated ``(None, axis, None)``.
      shared_experts.down_proj.weight: ``nnx.Param`` ``[H, S]`` bfloat16, annotated ``(None, axis)``.
      shared_experts: None when the front has no shared expert.

    Raises:
      ValueError: a bad config, backend, mesh, axis or shared_reduce, a bad weight (naming the key), or
        not exactly one of ``rngs`` and ``weights``.
    """

    def __init__(
        self,
        cfg: FrontConfig,
        *,
        rngs: nnx.Rngs | None = None,
        weights: Mapping[str, jax.Array] | None = None,
        shared: bool = True,
        backend: str = "auto",
        mesh: Mesh | None = None,
        axis: str = TP,
        shared_reduce: str = "psum",
    ):
        if not isinstance(cfg, FrontConfig):
            raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
        check_backend(backend)
        parallel.check_shared_reduce(shared_reduce)
        if mesh is None:
            if cfg.tp != 1:
                raise ValueError(
                    f"cfg.tp={cfg.tp} needs mesh=: a jax.sharding.Mesh with a {axis!r} axis of {cfg.tp} "
                    "devices (without a mesh the module holds every weight on one device)"
                )
            tp = 1
        else:
            tp = parallel.mesh_tp(cfg, mesh, axis)
            parallel.check_scatter(shared_reduce, cfg, tp)
        if (rngs is None) == (weights is None):
            raise ValueError("give exactly one of rngs= (fresh weights) and weights= (given weights)")
        if weights is None:
            if shared and not cfg.shared:
                raise ValueError("shared=True needs FrontConfig.shared > 0, got 0")
            weights = P.init_weights(rngs.params(), cfg, shared=shared)
        elif not shared:
            raise ValueError("shared=False applies to rngs=; with weights=, leave the shared keys out")
        self.cfg = cfg.with_tp(tp)
        has_shared = P.check_weights(weights, self.cfg)
        self.backend = backend
        self.mesh = mesh
        self.axis = axis
        self.shared_reduce = shared_reduce
        annotations = param_shardings(axis)

        def param(name):
            value = jnp.asarray(weights[name]).reshape(module_shape(name, cfg))
            if mesh is not None:
                value = jax.device_put(value, NamedSharding(mesh, PartitionSpec(*annotations[name])))
            return nnx.Param(value, out_sharding=annotations[name], eager_sharding=False)

        self.gate = _Gate(param(P.GATE), param(P.BIAS))
        self.routed_down_weight = param(P.ROUTED_DOWN)
        self.shared_experts = _SharedExperts(param(P.GATE_UP), param(P.DOWN)) if has_shared else None

    @classmethod
    def from_checkpoint(
        cls,
        paths_or_dir,
        cfg: FrontConfig,
        prefix: str = "",
        *,
        backend: str = "auto",
        mesh: Mesh | None = None,
        axis: str = TP,
        shared_reduce: str = "psum",
    ) -> MoEFront:
        """A module whose Params are read from a safetensors checkpoint (``mf.load_weights``' sources).

        With a ``mesh`` each device reads only its own shard of each weight from the files; no device
        ever holds a whole weight. Every key is checked (shape, dtype, presence) from the file headers
        before any data is read; the shared expert is there exactly when the checkpoint has its keys.

        Raises:
          ValueError: as ``MoEFront`` and ``mf.load_weights``, naming the checkpoint key at fault.
        """
        reader = checkpoint.CheckpointReader(paths_or_dir, cfg, prefix)
        abstract = nnx.eval_shape(lambda: cls(
            cfg, rngs=nnx.Rngs(0), shared=reader.has_shared, backend=backend, mesh=mesh, axis=axis,
            shared_reduce=shared_reduce,
        ))
        graphdef, state = nnx.split(abstract)
        for path, variable in nnx.to_flat_state(state):
            name = ".".join(map(str, path))
            sharding = (
                NamedSharding(mesh, PartitionSpec(*variable.get_metadata()["out_sharding"]))
                if mesh is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
            )
            variable.set_value(reader.read_array(name, variable.shape, sharding))
        return nnx.merge(graphdef, state)

    def weights(self) -> dict[str, jax.Array]:
        """The module's weights under the keys and shapes of SPEC section 2 (``gate_up`` as ``[2S, H]``).

        With a mesh the arrays keep their shards, except ``gate_up``: a rank's gate and up rows are not
        one block of ``[2S, H]``, so that one comes back replicated.
        """
        cfg = self.cfg
        weights = {
            P.GATE: self.gate.weight[...],
            P.BIAS: self.gate.e_score_correction_bias[...],
            P.ROUTED_DOWN: self.routed_down_weight[...],
        }
        if self.shared_experts is not None:
            gate_up = self.shared_experts.gate_up_proj.weight[...]
            replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
            weights[P.GATE_UP] = jnp.reshape(
                gate_up, (2 * cfg.shared, cfg.hidden), out_sharding=replicated
            )
            weights[P.DOWN] = self.shared_experts.down_proj.weight[...]
        return weights

    def __call__(self, x: jax.Array, *, plan: bool = False) -> FrontOutput:
        """The front of one decode step.

        Args:
          x: ``[B, H]`` bfloat16 decode rows, ``B >= 1``. With a mesh whose other axes split the batch
            (data parallel), ``B`` must divide by the product of their sizes.
          plan: also return the MXFP8 copy of the latent (``FrontOutput.plan``).

        Returns:
          ``FrontOutput(ids [B, K] int32, weights [B, K] bf16, latent [B, L] bf16, logits [B, E] f32,
          shared [B, H] bf16 or None, plan or None, status int32)``.
        """
        if self.mesh is None:
            params = P.pack_params(self.weights(), self.cfg)
            return moe_front(x, params, plan=plan, backend=self.backend, shared_reduce=self.shared_reduce)
        return self._sharded_call(x, plan)

    def _sharded_call(self, x: jax.Array, plan: bool) -> FrontOutput:
        cfg, mesh, axis = self.cfg, self.mesh, self.axis
        check_rows(x, cfg)
        others = tuple(name for name in mesh.axis_names if name != axis)
        groups = math.prod(mesh.shape[name] for name in others)
        if x.shape[0] % groups:
            raise ValueError(
                f"x has B={x.shape[0]} rows, split data-parallel over mesh axes {others} of {groups} "
                f"groups: B must be divisible by {groups}"
            )
        rows = PartitionSpec(others or None, None)
        explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
        if explicit:
            # shard_map takes x typed over Explicit axes only as its in_spec says; over Auto axes jit
            # reshards x itself (as mf.moe_front does on sharded params).
            split_rows = tuple(name for name in others if name in explicit) or None
            x = jax.reshard(x, NamedSharding(mesh, PartitionSpec(split_rows, None)))
        has_shared = self.shared_experts is not None
        names = [P.GATE, P.BIAS, P.ROUTED_DOWN] + list(P.SHARED_KEYS) * has_shared
        arrays = [self.gate.weight, self.gate.e_score_correction_bias, self.routed_down_weight]
        if has_shared:
            arrays += [self.shared_experts.gate_up_proj.weight, self.shared_experts.down_proj.weight]
        annotations = param_shardings(axis)
        split = P.padded_split(cfg.experts_per_rank)
        shared_spec = PartitionSpec(others or None, axis) if self.shared_reduce == "psum_scatter" else rows

        def body(x, *local):
            local = dict(zip(names, local))
            packing = [local[P.GATE], local[P.ROUTED_DOWN]]
            padding = split - cfg.experts_per_rank
            if padding:
                packing.insert(1, jnp.zeros((padding, cfg.hidden), jnp.bfloat16))
            gate_up = local[P.GATE_UP].reshape(-1, cfg.hidden) if has_shared else None
            params = FrontParams(
                jnp.concatenate(packing, axis=0), local[P.BIAS], gate_up, local.get(P.DOWN), cfg, split
            )
            out = moe_front(x, params, plan=plan, backend=self.backend, axis_name=axis,
                            shared_reduce=self.shared_reduce)
            return tuple(out)

        front = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(rows, *(PartitionSpec(*annotations[name]) for name in names)),
            out_specs=(rows, rows, rows, rows, shared_spec, rows, PartitionSpec()),
            # Pallas kernels in interpret mode do not carry the varying-axes types check_vma tracks.
            check_vma=not parallel.runs_kernels(self.backend, plan, has_shared),
        )
        return FrontOutput(*front(x, *(a[...] for a in arrays)))
