"""What the weight-streaming GEMMs share: the schedule (``schedule``) and the Triton pieces of the
split-K, stream-K and vector schedules (``triton``)."""
