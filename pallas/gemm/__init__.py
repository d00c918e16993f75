"""What the weight-streaming GEMMs share: the schedule, its lookup and the heuristic (``schedule``),
and the Triton loads, handshakes and launch (``triton``)."""
