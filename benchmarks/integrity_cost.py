"""What verification costs: checkpoint hashing (save and resume) and the Parquet part check on queries.

    .venv/bin/python benchmarks/integrity_cost.py [--gb 0.5] [--rows 10000000] [--steps 100] [--repeats 3]
                                                  [--only checkpoint|parts]

Checkpoints: a model + optimizer state of ``--gb`` GB saved with DCP (one
process) through the plain ``FileSystemWriter`` and through the hashing writer
of ``stages.checkpoint`` (sizes and sha256 computed as the bytes are written);
the difference is the save-time cost. At resume, ``verify_checkpoint`` with
sizes only and with hashes (the files re-read; warm page cache, as right after
a save, and the figure a resume of a recent checkpoint sees). Figures are per GB.

Parts: ``--rows`` token_stats rows over ``--steps`` steps (the generator of
``benchmarks/storage_scale.py``); ``connect`` + each of three shipped queries,
and the part check itself (each part's footer read and compared with its
location and its run's uid: ``identity_problem`` over every part), as a share of connect + the
queries. Goal <= 5%. Connect + queries with the check and without it
(``identity_problem`` replaced by a no-op) are printed too; on a shared machine
their difference is mostly noise.

Other jobs share the cores, so every figure is the median of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import storage.queries.catalog as catalog  # noqa: E402
from storage.checkpoints.verify import verify_checkpoint  # noqa: E402
from storage.queries import get_query  # noqa: E402
from storage.queries.catalog import connect, query, set_params  # noqa: E402
from storage.run.layout import RunLayout, read_run_info, scan_parts  # noqa: E402
from storage.tables.schemas import STORED_TABLES  # noqa: E402


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def checkpoint_cost(base: Path, gb: float, repeats: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from stages.checkpoint import hashing_dcp_writer
    from storage.checkpoints.store import save_checkpoint

    n = int(gb * 2**30 / 4 / 3)  # weights + two Adam moments, float32
    state = {"model": {"w": torch.randn(n)}, "optim": {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}}
    size = sum(t.numel() * 4 for part in state.values() for t in part.values()) / 2**30
    plain, hashed = [], []
    for i in range(repeats):
        for kind, out in (("plain", plain), ("hashed", hashed)):
            path = base / f"{kind}{i}"
            writer = FileSystemWriter(str(path)) if kind == "plain" else hashing_dcp_writer(path)[0]
            t = time.perf_counter()
            dcp.save(state, storage_writer=writer)
            out.append(time.perf_counter() - t)
            if kind == "plain" or i < repeats - 1:
                shutil.rmtree(path)
    p, h = statistics.median(plain), statistics.median(hashed)
    print(
        f"checkpoint: {size:.2f} GB DCP state; save {p / size:.2f} s/GB plain, {h / size:.2f} s/GB hashed while "
        f"written: +{(h - p) / size:.2f} s/GB (+{100 * (h - p) / p:.0f}%)"
    )
    run = base / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    writer, files = hashing_dcp_writer(run / "checkpoints" / ".dcp" / ".tmp-step_1-bench")
    dcp.save(state, storage_writer=writer)
    ck = save_checkpoint(run, 1, rng_state=False, dcp=(run / "checkpoints" / ".dcp" / ".tmp-step_1-bench", files))
    sizes = _median(lambda: verify_checkpoint(ck, hashes=False), repeats)
    hashes = _median(lambda: verify_checkpoint(ck, hashes=True), repeats)
    print(
        f"resume: verify sizes {sizes * 1000:.1f} ms in all; sizes + sha256 {hashes / size:.2f} s/GB "
        "(warm page cache; a cold read adds the disk's own read time)"
    )


def part_check_cost(base: Path, rows: int, steps: int, repeats: int) -> None:
    from storage_scale import QUERIES, make_step, write_run

    rng = np.random.default_rng(0)
    data = [make_step(rng, rows // steps, s) for s in range(steps)]
    n = sum(len(d["sample_id"]) for d in data)
    write_run(base / "parts", data)
    del data
    root = base / "parts"
    real = catalog.identity_problem

    def total(check: bool) -> tuple[float, float]:
        catalog.identity_problem = real if check else (lambda part, run_uid=None: None)
        try:
            t = time.perf_counter()
            con = connect(root)
            c = time.perf_counter() - t
            for name in QUERIES:
                q = get_query(name)
                set_params(con, {k: d for k, (d, _) in q.params.items()})
                query(con, q.sql)
            return c, time.perf_counter() - t
        finally:
            catalog.identity_problem = real

    total(True)  # warm the page cache
    on, off = [], []
    for _ in range(repeats):
        off.append(total(False))
        on.append(total(True))
    parts = [
        p
        for table in STORED_TABLES
        for p in scan_parts(RunLayout(root / "bench"), table, "bench")
        if p.name is not None
    ]
    uid = read_run_info(root / "bench").uid  # the footer is compared with the run's uid too
    check = _median(lambda: [real(p, uid) for p in parts], max(repeats, 5))
    c_on, c_off = statistics.median(c for c, _ in on), statistics.median(c for c, _ in off)
    t_on, t_off = statistics.median(t for _, t in on), statistics.median(t for _, t in off)
    print(
        f"parts: {n:,} token_stats rows in {steps} parts ({len(parts)} parts in all tables); "
        f"the check itself {check * 1000:.1f} ms = {100 * check / t_on:.2f}% of connect + {len(QUERIES)} queries "
        f"({t_on * 1000:.0f} ms)  goal <= 5%"
    )
    print(
        f"  with vs without the check (medians; the difference is within the machine's noise): connect "
        f"{c_on * 1000:.0f} vs {c_off * 1000:.0f} ms, connect + queries {t_on * 1000:.0f} vs {t_off * 1000:.0f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="Where to write (default: a temp folder, removed).")
    ap.add_argument("--only", choices=("checkpoint", "parts"), default=None, help="Run one of the two parts.")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="fp8rl-integrity-bench-", dir=args.dir))
    try:
        if args.only != "parts":
            (base / "ck").mkdir()
            checkpoint_cost(base / "ck", args.gb, args.repeats)
        if args.only != "checkpoint":
            part_check_cost(base, args.rows, args.steps, args.repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
