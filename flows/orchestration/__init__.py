"""Prefect for fp8rl: its environment, the temporary API server, and the campaign in its UI."""
