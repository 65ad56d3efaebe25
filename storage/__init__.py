"""fp8rl storage: what a campaign persists, and the SQL view of it.

- ``storage.schemas``     the tables, column by column (pyarrow schemas, schema version)
- ``storage.layout``      the run directory: paths, run.json, finding runs, live files
- ``storage.writer``      ``TableWriter``: atomic Parquet parts; retries set older parts aside
- ``storage.catalog``     ``connect(root)``: DuckDB views over the live parts of every run
- ``storage.ledger``      ``Ledger``: stage start/finish/failure, the truth for resume
- ``storage.checkpoints`` model/optimizer/RNG/sampler/calibrator state, atomic with a manifest
- ``storage.doctor``      checks of a run directory (``fp8rl doctor``)
- ``storage.queries``     named SQL queries shipped with the project (``fp8rl query --named``)

Nothing here imports Prefect or the other fp8rl packages; torch only inside
``storage.checkpoints`` functions.
"""
