"""What the weight-streaming GEMMs share: the schedule, its lookup and the heuristic (``schedule``),
the Triton loads, handshakes and launch (``triton``), and the Mosaic GPU launch, stage layout and
``x``'s TMA rows (``mosaic``)."""
