"""fp8rl stages."""
