"""fp8rl storage: what a campaign persists, and the SQL view of it, in rooms.

- ``storage/tables/``       the tables column by column (``schemas``), their specs (``spec``), the derived clip flags
- ``storage/run/``          the run directory (``layout``), the run's identity, its one-writer ``lock``
- ``storage/ledger/``       ``Ledger`` (``events``): stage start/finish/failure, the truth for resume; ``records``
- ``storage/checkpoints/``  ``store``: model/optimizer/RNG/sampler/calibrator state, atomic with a manifest;
                            ``format``, ``verify``, ``retention``: a checkpoint's files, is it complete, which to keep
- ``storage/parts/``        ``TableWriter`` (``writer``): atomic Parquet parts; ``checks``: is a part what it claims
- ``storage/queries/``      ``connect(root)`` (``catalog``): DuckDB views over every run; the named SQL queries
- beside the rooms: ``errors`` and ``faults`` (below them all), ``doctor`` (above them: ``fp8rl doctor``)

Nothing here imports Prefect or the other fp8rl packages; torch only inside
``storage.checkpoints.store`` functions.
"""
