"""The mailbox's GPU kernels outside Pallas (installed as ``moe_front_jax.bridge``):
``triton_mailbox`` (jax-triton publish and collect) and ``peer_mailbox`` (Mosaic GPU peer stores
across ranks). ``moe_front_jax.registry`` picks ``triton_mailbox``; ``moe_front_jax.mailbox`` calls
``peer_mailbox`` for ``transport="peer"``; ``moe_front_jax.reference.mailbox`` is their plain-JAX
statement."""
