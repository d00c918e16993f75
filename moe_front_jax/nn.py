"""The MoE front as a Flax NNX module: ``mf.nn.MoEFront``.

The module holds the weights of SPEC.md section 2 as ``nnx.Param`` under the model's own module names
(``gate.weight``, ``gate.e_score_correction_bias``, ``routed_down_weight``,
``shared_experts.gate_up_proj.weight``, ``shared_experts.down_proj.weight``), so ``nnx.state(front)``
paths read like the checkpoint's keys. Each Param carries its tensor-parallel annotation
(``out_sharding``, a tuple naming the mesh axis on the dimension the weight is split along), which
``nnx.get_partition_spec`` turns into a ``PartitionSpec``. At call time the module packs the weights into
``FrontParams`` (inside ``jit`` that is one concatenation) and calls ``mf.moe_front``.

Example::

  import jax, jax.numpy as jnp
  from flax import nnx
  import moe_front_jax as mf

  front = mf.nn.MoEFront(mf.KIMI_K3, rngs=nnx.Rngs(0))
  out = nnx.jit(lambda m, x: m(x))(front, x)   # x: [B, 7168] bfloat16 -> FrontOutput
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from moe_front_jax import params as P
from moe_front_jax.api import FrontOutput, moe_front
from moe_front_jax.backends import check_backend
from moe_front_jax.config import FrontConfig

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

    ``front(x)`` is ``mf.moe_front(x, mf.pack_params(front.weights(), cfg))``: the front GEMM, exact
    top-k routing, the latent and the shared expert of ``x`` ``[B, H]`` bfloat16.

    Args:
      cfg: the model config (``cfg.tp`` must be 1: one device holds every weight).
      rngs: draw fresh weights with ``mf.init_weights`` from ``rngs.params()``; give this or
        ``weights``.
      weights: the weights under the keys of SPEC section 2 (``mf.init_weights``' or
        ``mf.load_weights``' output), validated against ``cfg``.
      shared: with ``rngs``, also draw the shared expert's weights (needs ``cfg.shared > 0``). With
        ``weights`` the shared expert is there exactly when its keys are.
      backend: the backend ``moe_front`` runs (``"auto"``, ``"xla"``, ``"pallas"``, ``"interpret"``).

    Attributes:
      gate.weight: ``nnx.Param`` ``[E, H]`` bfloat16, annotated ``("tp", None)``.
      gate.e_score_correction_bias: ``nnx.Param`` ``[E]`` float32, annotated ``(None,)``.
      routed_down_weight: ``nnx.Param`` ``[L, H]`` bfloat16, annotated ``("tp", None)``.
      shared_experts.gate_up_proj.weight: ``nnx.Param`` ``[2, S, H]`` bfloat16 (the checkpoint's
        ``[2S, H]``, gate rows then up rows), annotated ``(None, "tp", None)``.
      shared_experts.down_proj.weight: ``nnx.Param`` ``[H, S]`` bfloat16, annotated ``(None, "tp")``.
      shared_experts: None when the front has no shared expert.

    Raises:
      ValueError: a bad config, backend or weight (naming the key), or not exactly one of ``rngs`` and
        ``weights``.
    """

    def __init__(
        self,
        cfg: FrontConfig,
        *,
        rngs: nnx.Rngs | None = None,
        weights: Mapping[str, jax.Array] | None = None,
        shared: bool = True,
        backend: str = "auto",
    ):
        if not isinstance(cfg, FrontConfig):
            raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
        if cfg.tp != 1:
            raise ValueError(f"cfg.tp must be 1 for a module on one device, got {cfg.tp}")
        check_backend(backend)
        if (rngs is None) == (weights is None):
            raise ValueError("give exactly one of rngs= (fresh weights) and weights= (given weights)")
        if weights is None:
            if shared and not cfg.shared:
                raise ValueError("shared=True needs FrontConfig.shared > 0, got 0")
            weights = P.init_weights(rngs.params(), cfg, shared=shared)
        elif not shared:
            raise ValueError("shared=False applies to rngs=; with weights=, leave the shared keys out")
        has_shared = P.check_weights(weights, cfg)
        self.cfg = cfg
        self.backend = backend
        annotations = param_shardings()

        def param(name):
            value = jnp.asarray(weights[name]).reshape(module_shape(name, cfg))
            return nnx.Param(value, out_sharding=annotations[name], eager_sharding=False)

        self.gate = _Gate(param(P.GATE), param(P.BIAS))
        self.routed_down_weight = param(P.ROUTED_DOWN)
        self.shared_experts = _SharedExperts(param(P.GATE_UP), param(P.DOWN)) if has_shared else None

    def weights(self) -> dict[str, jax.Array]:
        """The module's weights under the keys and shapes of SPEC section 2 (``gate_up`` as ``[2S, H]``)."""
        cfg = self.cfg
        weights = {
            P.GATE: self.gate.weight[...],
            P.BIAS: self.gate.e_score_correction_bias[...],
            P.ROUTED_DOWN: self.routed_down_weight[...],
        }
        if self.shared_experts is not None:
            gate_up = self.shared_experts.gate_up_proj.weight[...]
            weights[P.GATE_UP] = gate_up.reshape(2 * cfg.shared, cfg.hidden)
            weights[P.DOWN] = self.shared_experts.down_proj.weight[...]
        return weights

    def __call__(self, x: jax.Array, *, plan: bool = False) -> FrontOutput:
        """The front of one decode step.

        Args:
          x: ``[B, H]`` bfloat16 decode rows, ``B >= 1``.
          plan: also return the MXFP8 copy of the latent (``FrontOutput.plan``).

        Returns:
          ``FrontOutput(ids [B, K] int32, weights [B, K] bf16, latent [B, L] bf16, logits [B, E] f32,
          shared [B, H] bf16 or None, plan or None, status int32)``.
        """
        params = P.pack_params(self.weights(), self.cfg)
        return moe_front(x, params, plan=plan, backend=self.backend)
