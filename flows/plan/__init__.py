"""fp8rl plan: a campaign's memory per GPU, measured and computed, its generation work, whether it fits."""
