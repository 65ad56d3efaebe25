"""fp8rl flows."""
