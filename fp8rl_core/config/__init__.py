"""The campaign configuration: one frozen model of every section, validated at load."""
