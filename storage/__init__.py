"""fp8rl storage: what a campaign persists, and the SQL view of it.

- ``storage.schemas``     the tables, column by column (pyarrow schemas)
- ``storage.table_spec``  columns, table specs, the schema version, names that go into paths
- ``storage.clip_flags``  token_stats' derived ratios and clip flags
- ``storage.layout``      the run directory: paths, run.json, finding runs, live files
- ``storage.writer``      ``TableWriter``: atomic Parquet parts; retries set older parts aside
- ``storage.part_checks`` is a Parquet part what it claims to be (magic, footer identity, pages)
- ``storage.catalog``     ``connect(root)``: DuckDB views over the live parts of every run
- ``storage.ledger``      ``Ledger``: stage start/finish/failure, the truth for resume
- ``storage.ledger_records`` how the ledger's events fold into stage records
- ``storage.checkpoints`` model/optimizer/RNG/sampler/calibrator state, atomic with a manifest
- ``storage.checkpoint_format``, ``storage.checkpoint_verify``, ``storage.checkpoint_retention``
                          a checkpoint's files; is it complete; which ones to keep
- ``storage.doctor``      checks of a run directory (``fp8rl doctor``)
- ``storage.queries``     named SQL queries shipped with the project (``fp8rl query --named``)

Nothing here imports Prefect or the other fp8rl packages; torch only inside
``storage.checkpoints`` functions.
"""
