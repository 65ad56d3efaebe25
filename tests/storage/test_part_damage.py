"""A damaged part costs its own rows, never a query of anything else; doctor's verdicts are the right way round.

The fault matrix: for each stored table, one part is damaged so that the cheap
checks of the listing (the magic bytes, the footer's length, the identity keys
found in the footer's last bytes) still pass, and DuckDB, the reader of every
query, fails on it with an I/O error: where it starts reading, the bytes read
as a Thrift field longer than the file. Each kind of damage is chosen so:
random bytes from the first seed whose bytes do that, or for the length, the
first such place among the data pages:

| damage                                             | DuckDB fails           |
|----------------------------------------------------|------------------------|
| random bytes over the middle, the last 200 kept    | building the view      |
| random bytes over the footer's first 32            | building the view      |
| the footer's length, pointing among the data pages | building the view      |
| random bytes over the data pages (``steps``)       | reading the table      |

Each case checks that the run opens, that a query of every other table
returns all its rows, that the damaged table returns the other step's rows with
the part named, and that ``fp8rl doctor`` names the part (``--deep`` for the
data pages); for the middle, that ``fp8rl query`` of ``steps`` exits 0. Runs
are made with the storage API (no campaign), once per module, and copied per
case.
"""

from __future__ import annotations

import hashlib
import shutil
import struct
from pathlib import Path

import duckdb
import numpy as np
import pytest
from integrity_helpers import cli

from storage.doctor import ERROR, check
from storage.parts.checks import identity_problem, quick_parquet_check
from storage.parts.writer import TableWriter
from storage.queries.catalog import connect, problems, query
from storage.run.layout import Part, RunLayout, create_run, read_run_info, scan_parts
from storage.tables.schemas import STORED_TABLES

# a float whose bytes read as a Thrift binary field of 1 MiB: in the tables whose data pages hold no such
# bytes by chance, the footer's length can point at it
LONG_FIELD = struct.unpack("<d", b"\x18\x80\x80\x40\x00\x00\x00\x00")[0]
ROWS = {  # one step's rows of each table
    "rollouts": {"sample_id": np.arange(8), "prompt_id": np.arange(8) // 4, "response": [f"r{i}" for i in range(8)]},
    "scores": {"sample_id": np.arange(8), "prompt_id": np.arange(8) // 4, "score": np.linspace(0, 1, 8)},
    "token_stats": {
        "sample_id": np.repeat(np.arange(4), 8),
        "position": np.tile(np.arange(8), 4),
        "advantage": np.linspace(-1, 1, 32),
    },
    "steps": {"reward_mean": 0.5, "entropy_mean": LONG_FIELD},
    "bounds": {"mode": "calibrated", "lower": 0.8, "upper": 1.28, "alpha": LONG_FIELD},
    "evals": {"benchmark": "arith", "problem_id": np.arange(8), "correct": np.arange(8) % 2 == 0},
    "eval_scores": {"benchmark": "arith", "metric": "pass@1", "k": 1, "value": 0.5},
}
PER_STEP = {"rollouts": 8, "scores": 8, "token_stats": 32, "steps": 1, "bounds": 1, "evals": 8, "eval_scores": 1}
KINDS = ("middle", "footer", "footer length")


@pytest.fixture(scope="module")
def every_table(tmp_path_factory) -> Path:
    """A run with two steps of every stored table (a fixed uid, so its bytes are the same each time)."""
    assert set(ROWS) == set(STORED_TABLES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("storage.run.layout.new_run_uid", lambda: "5eed" * 8)
        run = create_run(tmp_path_factory.mktemp("damage"), "A").root
    w = TableWriter(run, durable=False)
    for table in STORED_TABLES:
        for step in (1, 2):
            w.write(table, step, ROWS[table], stage="x")
    return run


def _too_long_at(b: bytes, i: int) -> bool:
    """Do the bytes at ``i`` read as a Thrift compact field header of a binary (type 8) whose varint length
    runs past the end of the file (and under Thrift's own limits)?"""
    if b[i] & 0x0F != 8 or b[i] >> 4 == 0:
        return False
    length, shift = 0, 0
    for j in range(i + 1, min(i + 6, len(b))):
        length |= (b[j] & 0x7F) << shift
        shift += 7
        if not b[j] & 0x80:
            break
    return len(b) - i < length < 1 << 27


def _damaged(orig: bytes, kind: str) -> bytes:
    n, footer = len(orig), struct.unpack("<I", orig[-8:-4])[0]
    start = n - 8 - footer  # where the footer begins
    if kind == "footer length":
        i = next(i for i in range(4, start) if _too_long_at(orig, i))
        return orig[:-8] + struct.pack("<I", n - 8 - i) + orig[-4:]
    lo, hi, first_read = {
        "middle": (4, n - 200, start),
        "footer": (start, start + 32, start),
        "data pages": (4, start, 4),
    }[kind]
    for seed in range(10_000):
        b = bytearray(orig)
        b[lo:hi] = np.random.default_rng(seed).integers(0, 256, hi - lo, dtype=np.uint8).tobytes()
        if _too_long_at(b, first_read):
            return bytes(b)
    raise AssertionError("unreachable: about one seed in 40 fits")


def _damage(part: Part, uid: str, kind: str) -> None:
    """Damage ``part`` so that the listing's checks pass and DuckDB fails on it with an I/O error."""
    part.path.write_bytes(_damaged(part.path.read_bytes(), kind))
    assert quick_parquet_check(part.path) is None and identity_problem(part, uid) is None  # the premise
    read = "SELECT bit_xor(hash(t)) FROM read_parquet(?) t" if kind == "data pages" else "DESCRIBE FROM read_parquet(?)"
    with pytest.raises(duckdb.IOException, match="Could not read enough bytes"):
        duckdb.connect(":memory:").execute(read, [str(part.path)]).fetchall()


def _check_damage(run: Path, part: Part, kind: str) -> tuple[str, str]:
    """Every other table whole, the damaged one without the part, the part named (by the catalog, by doctor)."""
    con = connect(run)
    others = [t for t in STORED_TABLES if t != part.table]
    counts = query(con, "SELECT " + ", ".join(f"(SELECT count(*) FROM {t}) AS {t}" for t in others)).to_pylist()
    assert counts == [{t: 2 * PER_STEP[t] for t in others}], counts
    assert problems(con) == [] or kind != "data pages"  # its pages are read only by a query of its table
    rows = query(con, f"SELECT step, count(*) AS n FROM {part.table} GROUP BY step").to_pylist()
    assert rows == [{"step": 2, "n": PER_STEP[part.table]}], rows
    (named,) = problems(con)
    assert named[0] == str(part.path) and "corrupt Parquet" in named[1] and "skipped" in named[1], named
    found = [p for p in check(run, deep=kind == "data pages") if p.path == str(part.path)]
    assert found and all(p.severity == ERROR for p in found), found
    return named


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("table", STORED_TABLES)
def test_a_damaged_part_costs_its_own_rows_only(every_table: Path, tmp_path: Path, table: str, kind: str) -> None:
    run = tmp_path / "A"
    shutil.copytree(every_table, run)
    part = next(p for p in scan_parts(RunLayout(run), table, "A") if p.step == 1)
    _damage(part, read_run_info(run).uid, kind)
    named = _check_damage(run, part, kind)
    if kind == "middle":  # as reported: a query of steps exited 2 because of a part of another table
        r = cli("query", run, "SELECT count(*) AS n FROM steps", "--format", "csv")
        n = PER_STEP["steps"] * (1 if table == "steps" else 2)
        assert r.exit_code == 0 and r.stdout.splitlines()[1:] == [str(n)], r.stdout + r.stderr
        assert r.stderr.splitlines() == [f"warning: {part.path}: {named[1]}"], r.stderr


@pytest.mark.timeout(60)
def test_a_page_duckdb_cannot_read_is_found_by_the_query_that_reads_it(every_table: Path, tmp_path: Path) -> None:
    run = tmp_path / "A"
    shutil.copytree(every_table, run)
    part = next(p for p in scan_parts(RunLayout(run), "steps", "A") if p.step == 1)
    _damage(part, read_run_info(run).uid, "data pages")
    _check_damage(run, part, "data pages")


def test_a_table_that_still_cannot_be_read_fails_only_its_own_queries(
    every_table: Path, tmp_path: Path, monkeypatch
) -> None:
    import storage.queries.catalog as catalog

    run = tmp_path / "A"
    shutil.copytree(every_table, run)
    part = next(p for p in scan_parts(RunLayout(run), "scores", "A") if p.step == 1)
    _damage(part, read_run_info(run).uid, "middle")
    monkeypatch.setattr(catalog, "unreadable_parts", lambda files, err, data: [])  # no part to blame
    con = connect(run)
    assert query(con, "SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 2}]
    ((where, why),) = problems(con)
    assert why.startswith("table 'scores' cannot be read as a whole (IO Error: Could not read enough bytes"), why
    assert why.endswith("queries of it fail (run `fp8rl doctor`)") and where == str(run.resolve()), where
    with pytest.raises(duckdb.Error, match="table 'scores' cannot be read as a whole"):
        query(con, "SELECT count(*) FROM scores")
    r = cli("query", run, "SELECT count(*) FROM scores")
    assert r.exit_code == 2 and r.stderr.splitlines()[-1].startswith("error: "), r.stderr
    assert "cannot be read as a whole" in r.stderr.splitlines()[-1], r.stderr


# --------------------------------------------------------------------------- doctor


def test_doctor_refuses_a_checkpoint_folder_copied_to_another_step(tmp_path: Path) -> None:
    from storage.checkpoints.store import save_checkpoint
    from storage.checkpoints.verify import latest_complete

    run = create_run(tmp_path, "A").root
    tmp = run / "checkpoints" / ".dcp" / ".tmp-step_2-0000"
    tmp.mkdir(parents=True)
    shards = {}
    for name, data in ((".metadata", b"meta"), ("__0_0.distcp", b"shard" * 100)):
        (tmp / name).write_bytes(data)
        shards[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    save_checkpoint(run, 2, rng_state=False, dcp=(tmp, shards))
    assert check(run, deep=True) == []
    shutil.copytree(run / "checkpoints" / "step_2", run / "checkpoints" / "step_4")  # its shards stay step 2's
    found = check(run, deep=True)
    assert {(p.severity, p.path) for p in found} == {
        (ERROR, str(run / "checkpoints" / "step_4")),
        (ERROR, str(run / "checkpoints" / ".dcp" / "step_4")),
    }, found
    assert any("missing" in p.message and ".dcp/step_2" in p.message for p in found), found
    assert latest_complete(run) == run / "checkpoints" / "step_2"  # resume does not take it for step 4


def test_doctor_names_the_link_as_the_part_queries_ignore(tmp_path: Path) -> None:
    from integrity_helpers import run_with_rows

    from storage.run.layout import part_name

    run = run_with_rows(tmp_path / "runs", "A")
    other = run_with_rows(tmp_path / "other", "B")
    (real,) = (run / "tables" / "steps" / "run=A" / "step=2").glob("*.parquet")
    link = real.parent / part_name("train", 1, "main").filename  # newer than the real part
    link.symlink_to(next((other / "tables" / "steps" / "run=B" / "step=2").glob("*.parquet")))
    found = check(run)
    assert [(p.path, p.message.split(";")[0]) for p in found] == [
        (str(link), "a link, not a file the run's writer made")
    ], found
    r = cli("query", run, "SELECT reward_mean FROM steps WHERE step = 2", "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[1:] == ["0.2"], r.stdout + r.stderr  # the real part is read
