"""The RL objective: losses, advantages, GSPO, log-probs, mismatch corrections."""
