"""Pallas GPU kernels of the MoE front (installed as ``moe_front_jax.pallas``)."""
