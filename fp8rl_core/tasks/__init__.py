"""Tasks: the synthetic and stress arithmetic, the tiny code task, verifiers, the tiny model."""
