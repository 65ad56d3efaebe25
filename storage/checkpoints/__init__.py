"""Checkpoints: saving, loading, verifying and retaining them."""
