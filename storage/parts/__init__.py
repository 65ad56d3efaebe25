"""Parquet parts: written atomically, one per stage attempt, and checked cheaply."""
