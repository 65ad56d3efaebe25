"""Calibrated Clipping: the method, its estimators, subsampling, drift, BAPO, noise sources."""
