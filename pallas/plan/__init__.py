"""The MXFP8 plan of the latent (SPEC section 5): ``kernel`` holds the Pallas Triton kernel, its
heuristic schedule and the tile math the front GEMM's epilogue and ``route_collect`` share."""

from moe_front_jax.pallas.plan.kernel import PlanConfig, covers, pick_config, plan, plan_bytes

__all__ = ["PlanConfig", "covers", "pick_config", "plan", "plan_bytes"]
