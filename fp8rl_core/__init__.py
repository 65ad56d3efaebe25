"""fp8rl_core: pure numerics and algorithms of FP8 RL with Calibrated Clipping.

Tensors in, tensors out: no Prefect, no DuckDB, no files, no global state.
"""
