"""A run directory: where things live in it, the run's identity, and its one-writer lock."""
