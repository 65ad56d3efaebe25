"""Signals about a run: the guard, failure signals, diagnostics, evaluation metrics, paired statistics."""
