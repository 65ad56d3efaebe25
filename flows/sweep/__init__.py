"""fp8rl sweep: a matrix of campaigns, resumable cell by cell, ending in one comparison table."""
