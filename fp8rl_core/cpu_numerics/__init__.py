"""CPU numerics: the BF16 rule, CPU-independent exact GEMMs and transcendentals, the portable mode."""
