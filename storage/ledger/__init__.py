"""The stage ledger: which stage of which step started, finished or failed."""
