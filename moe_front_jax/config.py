"""Model configuration of the MoE front: sizes, routing constants and the tensor-parallel degree.

A config is a value (a frozen dataclass), not a constant: other models (grouped, softmax-routed, without
a latent; ``moe_front_jax.configs`` holds the presets) are other configs run through the same code.
Every size is validated when the config is built, so a bad config fails at its construction with the
field, its value and what was expected, or the combination of fields at fault.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import numpy as np

SCORINGS = ("sigmoid", "softmax")
ACTIVATIONS = ("situ", "silu")


@dataclasses.dataclass(frozen=True)
class FrontConfig:
    """Sizes and constants of one MoE front (SPEC.md section 1; presets in ``moe_front_jax.configs``).
    Frozen and hashable; a static pytree node, so ``jax.jit(f)(..., cfg)`` takes it as it is.

    Attributes:
      hidden, experts, top_k: model width ``H``, routed experts ``E``, experts per token ``K``.
      latent: the routed experts' input width ``L`` (rows of ``routed_down_weight``); 0: no latent.
      shared: shared-expert intermediate ``S`` (0: the model has no shared expert).
      routed_scaling_factor, renormalize: the routing weights' scale, and their division by the sum.
      situ_beta, linear_beta: constants of the shared expert's ``"situ"`` activation.
      tp: tensor-parallel ranks; ``experts``, ``latent`` and ``shared`` must divide by it.
      plan_block: elements per MXFP8 scale block of the latent plan.
      groups, topk_groups: expert groups and how many routing keeps (SPEC 4.2); 1, 1: none.
      scoring: ``"sigmoid"`` (SPEC section 4) or ``"softmax"`` (4.3).
      bias: the router has an ``e_score_correction_bias`` (sigmoid scoring only).
      activation: the shared expert's, ``"situ"`` (Kimi-K3) or ``"silu"`` (SPEC section 6).
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
    groups: int = 1
    topk_groups: int = 1
    scoring: str = "sigmoid"
    bias: bool = True
    activation: str = "situ"

    def __post_init__(self):
        counts = ("hidden", "experts", "top_k", "latent", "tp", "plan_block", "shared", "groups",
                  "topk_groups")
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))  # a NumPy integer is taken as its int
        for name in ("hidden", "experts", "top_k", "tp", "plan_block", "groups", "topk_groups"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"FrontConfig.{name} must be a positive int, got {value!r}")
        for name in ("latent", "shared"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"FrontConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("renormalize", "bias"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"FrontConfig.{name} must be a bool, got {value!r}")
            object.__setattr__(self, name, bool(value))
        for name, allowed in (("scoring", SCORINGS), ("activation", ACTIVATIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"FrontConfig.{name} must be one of {allowed}, got {value!r}")
        if self.top_k > self.experts:
            raise ValueError(
                f"FrontConfig.top_k={self.top_k} must be <= FrontConfig.experts={self.experts}"
            )
        self._check_routing()
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

    def _check_routing(self) -> None:
        """The combinations of groups, scoring and bias that SPEC section 4 defines."""
        g, kg, e = self.groups, self.topk_groups, self.experts
        if e % g:
            raise ValueError(f"FrontConfig.experts={e} must be divisible by groups={g}")
        if kg > g:
            raise ValueError(f"FrontConfig.topk_groups={kg} must be <= groups={g}")
        if g > 1 and e // g < 2:
            raise ValueError(
                f"FrontConfig.groups={g} leaves {e // g} expert per group (experts={e}); a group's "
                "score is the sum of its two best keys, so groups > 1 needs experts / groups >= 2"
            )
        if kg * (e // g) < self.top_k:
            raise ValueError(
                f"FrontConfig.topk_groups * experts / groups = {kg} * {e} / {g} = {kg * (e // g)} "
                f"experts are kept, fewer than top_k={self.top_k}"
            )
        if self.scoring == "softmax" and self.bias:
            raise ValueError(
                "FrontConfig.scoring='softmax' with bias=True: a correction bias is defined for "
                "sigmoid scoring only (pass bias=False)"
            )
        if self.scoring == "softmax" and g > 1:
            raise ValueError(
                f"FrontConfig.scoring='softmax' with groups={g}: grouped routing is defined for "
                "sigmoid scoring only"
            )

    @property
    def experts_per_group(self) -> int:
        """Experts in each group: ``experts / groups``."""
        return self.experts // self.groups

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
