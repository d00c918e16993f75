"""Model configuration of the MoE front: sizes, routing constants and the tensor-parallel degree.

A config is a value (a frozen dataclass), not a constant: other sigmoid-routed models are other configs
run through the same code. Every size is validated when the config is built, so a bad config fails at
its construction with the field, its value and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    """Sizes and constants of one MoE front (SPEC.md section 1). Frozen and hashable; a static pytree
    node, so ``jax.jit(f)(..., cfg)`` takes it without ``static_argnames``.

    Attributes:
      hidden: model width ``H``, the front GEMM's K.
      experts: routed experts ``E``.
      top_k: experts chosen per token ``K``.
      latent: width ``L`` of the routed experts' input (rows of ``routed_down_weight``).
      shared: shared-expert intermediate ``S`` (0: the model has no shared expert).
      routed_scaling_factor: multiplies the routing weights.
      renormalize: divide the chosen weights by their sum.
      situ_beta, linear_beta: constants of the shared expert's activation.
      tp: tensor-parallel ranks; ``experts``, ``latent`` and ``shared`` must divide by it.
      plan_block: elements per MXFP8 scale block of the latent plan.
    """

    hidden: int = 7168
    experts: int = 896
    top_k: int = 16
    latent: int = 3584
    shared: int = 6144
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    situ_beta: float = 4.0
    linear_beta: float = 25.0
    tp: int = 1
    plan_block: int = 32

    def __post_init__(self):
        for name in ("hidden", "experts", "top_k", "latent", "tp", "plan_block", "shared"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))  # a NumPy integer is taken as its int
        for name in ("hidden", "experts", "top_k", "latent", "tp", "plan_block"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"FrontConfig.{name} must be a positive int, got {value!r}")
        if type(self.shared) is not int or self.shared < 0:
            raise ValueError(f"FrontConfig.shared must be an int >= 0, got {self.shared!r}")
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise ValueError(f"FrontConfig.renormalize must be a bool, got {self.renormalize!r}")
        object.__setattr__(self, "renormalize", bool(self.renormalize))
        if self.top_k > self.experts:
            raise ValueError(
                f"FrontConfig.top_k={self.top_k} must be <= FrontConfig.experts={self.experts}"
            )
        for name in ("routed_scaling_factor", "situ_beta", "linear_beta"):
            value = getattr(self, name)
            if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"FrontConfig.{name} must be a finite number > 0, got {value!r}")
            # A NumPy float is taken as its Python float: equal configs hash equal (jit's static
            # arguments).
            object.__setattr__(self, name, float(value))
        for name in ("experts", "latent", "shared"):
            value = getattr(self, name)
            if value % self.tp:
                raise ValueError(
                    f"FrontConfig.{name}={value} must be divisible by tp={self.tp}"
                )
        if self.latent % self.plan_block:
            raise ValueError(
                f"FrontConfig.latent={self.latent} must be divisible by "
                f"plan_block={self.plan_block} (MXFP8 scale blocks)"
            )

    @property
    def experts_per_rank(self) -> int:
        """Router rows a rank holds: ``experts / tp`` (the SPEC's ``valid``)."""
        return self.experts // self.tp

    @property
    def latent_per_rank(self) -> int:
        """Latent rows a rank holds: ``latent / tp`` (the SPEC's ``shard``)."""
        return self.latent // self.tp

    @property
    def shared_per_rank(self) -> int:
        """Shared-expert intermediate a rank holds: ``shared / tp``."""
        return self.shared // self.tp

    @property
    def mailbox_width(self) -> int:
        """16-bit columns of a mailbox row: the latent, then the logits as float32 words."""
        return self.latent + 2 * self.experts

    def with_tp(self, tp: int) -> FrontConfig:
        """The same model split over ``tp`` ranks (validated)."""
        return dataclasses.replace(self, tp=tp)


# A config is a static pytree node (no leaves; the config itself is the treedef's auxiliary data,
# hashed and compared by value): passed to a jitted function, it is part of the trace's key, as a
# static argument would be, with no static_argnames needed.
jax.tree_util.register_static(FrontConfig)

KIMI_K3 = FrontConfig()
"""Kimi-K3: 7168 wide, 896 experts, top-16, latent 3584, shared intermediate 6144."""
