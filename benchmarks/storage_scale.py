"""Storage at scale: 10M ``token_stats`` rows over 100 steps, written and queried.

    .venv/bin/python benchmarks/storage_scale.py [--rows 10000000] [--steps 100] [--repeats 5]

Prints write throughput (rows/s, through ``TableWriter.write`` with fsync and
the atomic rename), on-disk bytes per token row, and the time of three typical
queries over all rows (the shipped named queries calibration-history,
clip-shares-by-sign, entropy-bins) plus the catalog's connect time. Goals on a
2-core machine: >= 2M rows/s, each query <= 1 s, <= 20 bytes/row.

Then the cost of DuckDB's check of every part (``storage.queries.catalog``): what it
takes DuckDB to read every listed footer (the views are built on those reads,
so a healthy run pays nothing more), what checking each part alone would cost,
and connect plus the three queries with one ``token_stats`` part damaged so
that only DuckDB finds it (its footer's first field claims 1 MiB): the first
look, which reads that table's footers one by one, and a later one in the
same process, which finds the verdicts kept per (path, size, mtime).

Data is generated to resemble a real calibration step, so the floats compress
as real ones do (random mantissas; nothing constant except per-step bounds):
responses of 50-2000 tokens in GRPO groups of 8 with 0/1 rewards, one
advantage per sequence; old log-probs a mix of confident tokens (|logp| ~ 1e-2)
and uncertain ones (~2 nats); the new policy a small step away; BF16 shadow
log-probs the FP8 ones minus quantization noise; entropy tied to confidence.

Other jobs share the cores, so every figure is the median of ``--repeats``
runs (writes: the whole 10M-row write is repeated into fresh directories).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from storage.parts.writer import TableWriter  # noqa: E402
from storage.queries import get_query  # noqa: E402
from storage.queries.catalog import connect, query, set_params  # noqa: E402
from storage.run.layout import create_run  # noqa: E402

QUERIES = ("calibration-history", "clip-shares-by-sign", "entropy-bins")


def make_step(rng: np.random.Generator, n_tokens: int, step: int) -> dict[str, np.ndarray | float]:
    """One step's token rows (about ``n_tokens``), as the train stage would pass them."""
    lengths = []
    while sum(lengths) < n_tokens:
        lengths.append(int(rng.integers(50, 2000)))
    lengths[-1] -= sum(lengths) - n_tokens
    lengths = np.array([l for l in lengths if l > 0])
    n_seq = len(lengths)
    rewards = (rng.random(n_seq) < 0.4).astype(np.float32)
    groups = np.arange(n_seq) // 8
    adv_seq = np.empty(n_seq, np.float32)
    for g in np.unique(groups):
        r = rewards[groups == g]
        std = r.std(ddof=1) if len(r) > 1 else 1.0
        adv_seq[groups == g] = (r - r.mean()) / (std + 1e-6)
    sample_id = np.repeat(np.arange(n_seq, dtype=np.int32), lengths)
    position = np.concatenate([np.arange(l, dtype=np.int32) for l in lengths])
    m = len(sample_id)
    confident = rng.random(m) < 0.7
    old = np.where(confident, -rng.exponential(0.01, m), -rng.exponential(2.0, m)).astype(np.float32)
    logp = (old + rng.normal(0.0, 0.03, m) * np.sqrt(-old + 1e-3)).astype(np.float32)
    old_bf16 = (old + rng.normal(0.0, 0.004, m)).astype(np.float32)
    logp_bf16 = (logp + rng.normal(0.0, 0.004, m)).astype(np.float32)
    entropy = np.where(confident, rng.exponential(0.05, m), rng.exponential(1.2, m)).astype(np.float32)
    lower = 0.8 - 0.05 * np.tanh(step / 40)
    return {
        "sample_id": sample_id,
        "position": position,
        "epoch": 0,
        "minibatch": (sample_id * 4 // n_seq).astype(np.int16),
        "advantage": np.repeat(adv_seq, lengths),
        "logp_fp8": logp,
        "old_logp_fp8": old,
        "logp_bf16": logp_bf16,
        "old_logp_bf16": old_bf16,
        "entropy": entropy,
        "lower_bound": float(lower),
        "upper_bound": 1.28,
        "standard_lower": 0.8,
        "standard_upper": 1.28,
    }


def bounds_row(step: int) -> dict[str, float | str]:
    lower = 0.8 - 0.05 * np.tanh(step / 40)
    return {
        "mode": "calibrated",
        "alpha": 0.02,
        "raw_lower": lower - 0.01,
        "raw_upper": 1.3,
        "lower": lower,
        "upper": 1.28,
        "target_balance": 1.1,
        "balance_before": 0.9,
        "balance_after": 1.08,
        "tokens": 100_000,
    }


def write_run(root: Path, data: list[dict]) -> tuple[float, float, int]:
    """Write every step; return (wall s, CPU s spent in token_stats writes, bytes on disk)."""
    layout = create_run(root, "bench", config={"benchmark": "storage_scale"})
    writer = TableWriter(layout.root)
    wall = cpu = 0.0
    for step, cols in enumerate(data):
        t0, c0 = time.perf_counter(), time.process_time()
        writer.write("token_stats", step, cols, stage="train")
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        writer.write("bounds", step, bounds_row(step), stage="calibrate")
    size = sum(p.stat().st_size for p in layout.table_dir("token_stats").rglob("*.parquet"))
    return wall, cpu, size


def _connect_and_query(root: Path) -> tuple[float, float]:
    """Seconds for connect, and for connect plus the three queries."""
    t = time.perf_counter()
    con = connect(root)
    c = time.perf_counter() - t
    for name in QUERIES:
        q = get_query(name)
        set_params(con, {k: d for k, (d, _) in q.params.items()})
        query(con, q.sql)
    return c, time.perf_counter() - t


def part_check_cost(root: Path, repeats: int) -> None:
    """DuckDB's check of every part: healthy, per part, and with one part only DuckDB finds damaged."""
    import duckdb

    from storage.parts.checks import footer_problem, forget_verdicts
    from storage.queries.catalog import problems
    from storage.run.layout import RunLayout, scan_parts
    from storage.tables.schemas import STORED_TABLES

    parts = [str(p.path) for t in STORED_TABLES for p in scan_parts(RunLayout(root / "bench"), t, "bench")]
    listing = "[" + ", ".join(f"'{p}'" for p in parts) + "]"
    probe = duckdb.connect(":memory:")

    def footers() -> float:
        t = time.perf_counter()
        probe.execute(f"SELECT count(*) FROM parquet_schema({listing})").fetchall()
        return time.perf_counter() - t

    def one_by_one() -> float:
        forget_verdicts()
        t = time.perf_counter()
        for p in parts:
            footer_problem(p, probe)
        return time.perf_counter() - t

    read = statistics.median(footers() for _ in range(repeats))
    alone = statistics.median(one_by_one() for _ in range(repeats))
    healthy = [_connect_and_query(root) for _ in range(repeats)]
    c_ok, t_ok = statistics.median(c for c, _ in healthy), statistics.median(t for _, t in healthy)
    print(
        f"part check: DuckDB reads all {len(parts)} footers in {read * 1000:.0f} ms (the views are built on "
        f"these reads: a healthy run pays nothing more; connect {c_ok * 1000:.0f} ms, "
        f"connect + {len(QUERIES)} queries {t_ok * 1000:.0f} ms); each part alone would cost {alone * 1000:.0f} ms "
        f"= {100 * alone / t_ok:.1f}% of connect + queries"
    )
    victim = next(p for p in scan_parts(RunLayout(root / "bench"), "token_stats", "bench") if p.step == 50).path
    orig = victim.read_bytes()
    footer = int.from_bytes(orig[-8:-4], "little")
    start = len(orig) - 8 - footer
    victim.write_bytes(orig[:start] + b"\x18\x80\x80\x40" + orig[start + 4 :])  # a first field of 1 MiB
    try:
        first, later = [], []
        for _ in range(repeats):
            forget_verdicts()
            first.append(_connect_and_query(root))
            later.append(_connect_and_query(root))
        con = connect(root)
        assert [p for p, _ in problems(con)] == [str(victim)], problems(con)
    finally:
        victim.write_bytes(orig)
    c1, t1 = statistics.median(c for c, _ in first), statistics.median(t for _, t in first)
    c2, t2 = statistics.median(c for c, _ in later), statistics.median(t for _, t in later)
    print(
        f"one damaged token_stats part: connect {c1 * 1000:.0f} ms at the first look (+{(c1 - c_ok) * 1000:.0f} ms), "
        f"{c2 * 1000:.0f} ms later in the same process (+{(c2 - c_ok) * 1000:.0f} ms); connect + queries "
        f"{t1 * 1000:.0f} / {t2 * 1000:.0f} ms against {t_ok * 1000:.0f} ms healthy"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="Where to write (default: a temp folder, removed).")
    args = ap.parse_args()

    per_step = args.rows // args.steps
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    data = [make_step(rng, per_step, s) for s in range(args.steps)]
    rows = sum(len(d["sample_id"]) for d in data)
    print(f"generated {rows:,} token rows over {args.steps} steps in {time.perf_counter() - t0:.1f}s")

    base = Path(tempfile.mkdtemp(prefix="fp8rl-storage-bench-", dir=args.dir))
    try:
        write_s, cpu_s, sizes = [], [], []
        for i in range(args.repeats):
            s, c, size = write_run(base / f"w{i}", data)
            write_s.append(s)
            cpu_s.append(c)
            sizes.append(size)
            if i < args.repeats - 1:
                shutil.rmtree(base / f"w{i}")
        del data
        root = base / f"w{args.repeats - 1}"
        w = statistics.median(write_s)
        bpr = statistics.median(sizes) / rows
        print(
            f"write: {rows / w / 1e6:.2f} M rows/s (median of {args.repeats}: {w:.2f}s; "
            f"all: {', '.join(f'{x:.2f}' for x in write_s)})  goal >= 2 M rows/s"
        )
        print(
            f"write CPU: {statistics.median(cpu_s):.2f}s = "
            f"{rows / statistics.median(cpu_s) / 1e6:.2f} M rows per CPU-second "
            "(encode + fsync syscalls; the rate of an unshared core)"
        )
        print(f"size: {bpr:.2f} bytes/row ({statistics.median(sizes) / 1e6:.0f} MB)  goal <= 20")

        con_s = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            con = connect(root)
            con_s.append(time.perf_counter() - t)
        print(f"connect: {statistics.median(con_s) * 1000:.0f} ms")
        threads = con.sql("SELECT current_setting('threads')").fetchall()[0][0]
        for name in QUERIES:
            q = get_query(name)
            set_params(con, {k: d for k, (d, _) in q.params.items()})
            times, cpu = [], []
            for _ in range(args.repeats):
                t, c = time.perf_counter(), time.process_time()
                result = query(con, q.sql)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            med = statistics.median(times)
            print(
                f"query {name}: {med * 1000:.0f} ms median wall, {statistics.median(cpu) * 1000:.0f} ms CPU "
                f"on {threads} threads ({result.num_rows} rows; all: {', '.join(f'{x * 1000:.0f}' for x in times)} ms)"
                "  goal <= 1000 ms"
            )
        part_check_cost(root, args.repeats)
        print(
            f"load average (1/5 min) at the end: {os.getloadavg()[0]:.1f} / {os.getloadavg()[1]:.1f} "
            f"on {os.cpu_count()} cores — other jobs inflate wall times"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
