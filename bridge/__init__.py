"""The custom-call bridge: jax-triton kernels for the Lamport mailbox (``moe_front_jax.bridge``)."""
