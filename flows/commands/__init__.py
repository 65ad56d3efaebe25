"""The fp8rl commands, one module per group; flows/cli.py registers them."""
