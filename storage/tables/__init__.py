"""The tables of a campaign: their specs, schemas and derived columns."""
