"""What the weight-streaming GEMMs share: the Triton schedules' config classes (``GridConfig``,
``StreamKConfig``, ``VectorConfig``), their JSON form, lookup and heuristic (``schedule``), the Triton
loads, handshakes and launch (``triton``), and the Mosaic GPU launch, wgmma's shapes, stage layout
and ``x``'s TMA rows (``mosaic``)."""
