"""Process plumbing every run shares: the shutdown path, the child guard, torchrun as fp8rl starts it."""
