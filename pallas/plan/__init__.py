"""The MXFP8 plan of the latent (SPEC section 5), one Pallas Triton kernel (``kernel``)."""

from moe_front_jax.pallas.plan.kernel import PlanConfig, covers, pick_config, plan, plan_bytes

__all__ = ["PlanConfig", "covers", "pick_config", "plan", "plan_bytes"]
