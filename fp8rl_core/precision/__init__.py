"""Low-precision formats and layers: FP8/FP4 formats, training and rollout linears, conversion, the BF16 shadow."""
