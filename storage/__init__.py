"""fp8rl storage."""
