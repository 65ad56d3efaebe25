"""``fp8rl report``: one HTML page (plus PNGs) telling a campaign's story, several runs overlaid.

    fp8rl report runs/tiny-cpu-20260101-120000
    fp8rl report runs/sweeps/paper-tiny --out reports/paper-tiny     # a folder of runs
    fp8rl report runs/a runs/b --out reports/a-vs-b

Each argument is a catalog *root* (a run directory or a folder of them, see
``storage.queries.catalog``). Every figure of :mod:`flows.report.figures` is one SQL
query run on each root's in-memory DuckDB catalog; the results are
concatenated (one line per ``run_id``, the same colour for a run in every
figure) and drawn with matplotlib's object API (``matplotlib.figure.Figure``
on the Agg canvas: no pyplot state, no display needed).

The output folder holds ``index.html``, one ``<figure>.png`` and
``<figure>.sql`` per figure with data, and ``table.csv`` (the ``paper-table``
named query). The page needs no network, script or stylesheet from elsewhere:
it references only files written beside it. A figure without data (e.g. no
BF16 shadow steps, so no NMAE) gets a sentence saying so, never empty axes;
a panel without data is left out and named under the figure.

:func:`build_report` returns what it drew — rows per figure, lines per panel —
so tests (and the CLI's summary) can check that every rendered figure has data.
"""

from __future__ import annotations

import html
import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from flows.report.figures import FIGURES, Figure, Panel
from storage.queries import get_query
from storage.queries.catalog import connect, problems, query, set_params
from storage.run.layout import RunInfo, find_runs

RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf")
COLUMN_STYLES = ("-", "--", ":", "-.")
TABLE_QUERY = "paper-table"


@dataclass(frozen=True)
class PanelResult:
    """One drawn axes: its title, the lines on it and their finite points."""

    title: str
    lines: int
    points: int


@dataclass
class FigureResult:
    """What became of one figure: ``png`` is None when it had no data (see ``note``)."""

    figure: Figure
    rows: int
    png: str | None = None
    panels: list[PanelResult] = field(default_factory=list)
    note: str | None = None


@dataclass
class Report:
    """A built report: the page, the figures, the comparison table, the time it took."""

    out_dir: Path
    index: Path
    runs: list[tuple[str, RunInfo]]  # (label, info)
    figures: list[FigureResult]
    table: pa.Table
    seconds: float
    problems: list[tuple[str, str]]
    jobs: pa.Table | None = None  # the runs' cluster jobs (fp8rl submit), None when no run had one


JOBS_SQL = (
    "SELECT run_id, attempt, job_id, nodes, state, exit_reason, resumed_from_step, submitted_at, ended_at "
    "FROM job_attempts ORDER BY run_id, attempt"
)


# --------------------------------------------------------------------------- querying


@dataclass
class _Source:
    """One root: its catalog connection and the labels of its runs in the report."""

    root: Path
    con: duckdb.DuckDBPyConnection
    labels: dict[str, str]


def _open_sources(roots: list[Path]) -> tuple[list[_Source], list[tuple[str, RunInfo]]]:
    """Connect each root; a run id seen under two roots is labelled ``id@<name of its parent folder>``."""
    found = [(Path(r), find_runs(r)) for r in roots]
    count: dict[str, int] = {}
    for _, infos in found:
        for i in infos:
            count[i.run_id] = count.get(i.run_id, 0) + 1
    sources, runs = [], []
    for root, infos in found:
        labels = {i.run_id: (i.run_id if count[i.run_id] == 1 else f"{i.run_id}@{i.path.resolve().parent.name}")
                  for i in infos}
        sources.append(_Source(root, connect(root), labels))
        runs += [(labels[i.run_id], i) for i in infos]
    return sources, runs


def _one_line(err: BaseException) -> str:
    return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)


def run_sql(sources: list[_Source], sql: str, params: dict | None = None) -> tuple[pa.Table | None, list[str]]:
    """``sql`` on every root, concatenated, ``run_id`` replaced by the report label.

    A root whose views lack a column the SQL names (a run without shadow
    metrics, an older run) contributes no rows and a note; other errors raise.
    """
    tables, notes = [], []
    for src in sources:
        if params:
            set_params(src.con, params)
        try:
            t = query(src.con, sql)
        except (duckdb.BinderException, duckdb.CatalogException) as err:
            notes.append(f"{src.root}: {_one_line(err)}")
            continue
        if "run_id" in t.column_names:
            ids = [src.labels.get(r, r) for r in t.column("run_id").to_pylist()]
            t = t.set_column(t.column_names.index("run_id"), "run_id", pa.array(ids, pa.string()))
        tables.append(t)
    if not tables:
        return None, notes
    return pa.concat_tables(tables, promote_options="permissive"), notes


# --------------------------------------------------------------------------- plotting


def _floats(values: list) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) else math.nan for v in values]


def _resolve_panels(panels: tuple[Panel, ...], columns: list[str]) -> list[tuple[Panel, str, list[str]]]:
    """(panel, title, columns) per axes to draw, ``each`` panels expanded."""
    out = []
    for p in panels:
        matched = [c for c in columns if re.fullmatch(p.columns, c)]
        if p.each:
            out += [(p, c, [c]) for c in matched]
        else:
            out.append((p, p.title, matched))
    return out


def plot_figure(fig_spec: Figure, table: pa.Table, colors: dict[str, str], path: Path) -> list[PanelResult]:
    """Draw ``table`` (run_id, step, value columns) as ``fig_spec`` says; save a PNG at ``path``.

    Returns the drawn panels; an empty list means no panel had a finite point
    and nothing was saved.
    """
    from matplotlib.figure import Figure as MplFigure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    data = table.to_pydict()
    runs = list(dict.fromkeys(data["run_id"]))
    value_cols = [c for c in table.column_names if c not in ("run_id", "step")]
    series: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for col in value_cols:
        for run in runs:
            pts = [(s, v) for r, s, v in zip(data["run_id"], data["step"], _floats(data[col]))
                   if r == run and s is not None and math.isfinite(v)]
            if pts:
                series[(run, col)] = ([s for s, _ in pts], [v for _, v in pts])

    todo = [(p, title, [c for c in cols if any((r, c) in series for r in runs)])
            for p, title, cols in _resolve_panels(fig_spec.panels, value_cols)]
    todo = [t for t in todo if t[2]]
    if not todo:
        return []
    ncols = min(3, len(todo))
    nrows = math.ceil(len(todo) / ncols)
    # Fixed margins rather than layout="constrained": the constrained solver re-measures every
    # tick label and costs as much as the drawing itself (half of the report's build time).
    legend_rows = math.ceil(len(runs) / 5)
    height = 3.1 * nrows + 0.3 + 0.25 * legend_rows
    fig = MplFigure(figsize=(4.6 * ncols, height))
    fig.subplots_adjust(left=0.09 if ncols > 1 else 0.17, right=0.98, top=1 - 0.35 / height,
                        bottom=(0.8 + 0.25 * legend_rows) / height, wspace=0.28, hspace=0.55)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    results = []
    for ax, (panel, title, cols) in zip(axes, todo):
        labels = dict(panel.labels)
        points = 0
        for j, col in enumerate(cols):
            for run in runs:
                if (run, col) not in series:
                    continue
                xs, ys = series[(run, col)]
                sparse = fig_spec.markers or len(xs) <= 2
                ax.plot(xs, ys, COLUMN_STYLES[j % len(COLUMN_STYLES)], color=colors[run], lw=1.4,
                        marker="o" if sparse else None, ms=3.5)
                points += len(xs)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if panel.log_y:
            ax.set_yscale("log")
        if len(cols) > 1:  # line styles tell the columns apart; colours are the runs (figure legend)
            styles = [COLUMN_STYLES[j % len(COLUMN_STYLES)] for j in range(len(cols))]
            ax.legend([Line2D([], [], color="#333", ls=ls) for ls in styles],
                      [labels.get(c, c) for c in cols], fontsize=7, loc="best")
        results.append(PanelResult(title, len(ax.get_lines()), points))
    for ax in axes[len(todo):]:
        ax.set_visible(False)
    fig.legend([Line2D([], [], color=colors[r], lw=2) for r in runs], runs, loc="lower center",
               ncols=min(len(runs), 5), fontsize=8, frameon=False)
    fig.savefig(path, dpi=90)
    return results


# --------------------------------------------------------------------------- the page

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1400px;margin:1.5em auto;
  padding:0 1em;color:#222}
h1{margin-bottom:.2em} h2{margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
th{background:#f4f4f4} td.l,th.l{text-align:left} img{max-width:100%;height:auto;display:block;margin:.5em 0}
pre{background:#f7f7f7;padding:.8em;overflow-x:auto;font-size:12px} .nodata{color:#a33;font-style:italic}
.note{color:#666;font-size:13px}
.swatch{display:inline-block;width:.9em;height:.9em;border-radius:2px;vertical-align:middle;margin-right:.4em}
nav a{margin-right:1em} .scroll{overflow-x:auto}
"""


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def _html_table(table: pa.Table, colors: dict[str, str] | None = None) -> str:
    pylist = table.to_pylist()
    text = {c for c in table.column_names if any(isinstance(r[c], str) for r in pylist)}  # left-aligned
    head = "".join(f'<th class="{"l" if c in text else ""}">{html.escape(c)}</th>' for c in table.column_names)
    rows = []
    for r in pylist:
        cells = []
        for i, (c, v) in enumerate(r.items()):
            shown = i == 0 and colors and v in colors
            swatch = f'<span class="swatch" style="background:{colors[v]}"></span>' if shown else ""
            cells.append(f'<td class="{"l" if c in text else ""}">{swatch}{_cell(v)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(rows)}</table></div>'


def _query_hint(roots: list[Path], sql_file: str) -> str:
    root = html.escape(str(roots[0]))
    cmd = f'fp8rl query {root} "$(cat {html.escape(sql_file)})"'
    return f'<p class="note">Re-run: <code>{cmd}</code> (from the report folder).</p>'


def render_html(report: Report, roots: list[Path], colors: dict[str, str], table_sql: str) -> str:
    """The page: runs, the comparison table, then each figure with its SQL."""
    runs_table = pa.table({
        "run": [label for label, _ in report.runs],
        "directory": [str(i.path) for _, i in report.runs],
        "created": [i.created_at for _, i in report.runs],
        "config hash": [(i.config_hash or "")[:12] for _, i in report.runs],
    })
    nav = " ".join(f'<a href="#{f.figure.name}">{html.escape(f.figure.title)}</a>' for f in report.figures)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>fp8rl report: {html.escape(', '.join(label for label, _ in report.runs)[:120])}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>fp8rl report</h1>",
        f'<p class="note">{len(report.runs)} run(s) from {html.escape(", ".join(map(str, roots)))}; '
        f"built {datetime.now().isoformat(timespec='seconds')}.</p>",
        f"<nav>{nav}</nav>", "<h2>Runs</h2>", _html_table(runs_table, colors),
        '<h2 id="table">Comparison</h2>',
        '<p class="note">The <code>paper-table</code> named query (<a href="table.csv">table.csv</a>); '
        "its header in the SQL explains each column.</p>",
        _html_table(report.table, colors),
        f"<details><summary>SQL</summary><pre>{html.escape(table_sql)}</pre></details>",
    ]
    if report.jobs is not None and report.jobs.num_rows:
        parts.append('<h2>Cluster jobs</h2><p class="note">Each job of <code>fp8rl submit</code>, recorded when it '
                     "ended (the <code>job_attempts</code> view).</p>")
        parts.append(_html_table(report.jobs, colors))
    if report.problems:
        items = "".join(f"<li>{html.escape(p)}: {html.escape(w)}</li>" for p, w in report.problems)
        parts.append(f'<h2>Skipped files</h2><ul class="note">{items}</ul>')
    for f in report.figures:
        fs = f.figure
        parts.append(f'<section id="{fs.name}"><h2>{html.escape(fs.title)}</h2><p>{html.escape(fs.caption)}</p>')
        if f.png is None:
            parts.append(f'<p class="nodata">No data: {html.escape(f.note or fs.no_data)}.</p>')
        else:
            parts.append(f'<img src="{html.escape(f.png)}" alt="{html.escape(fs.title)}">')
            if f.note:
                parts.append(f'<p class="note">{html.escape(f.note)}</p>')
        parts.append(f'<details><summary>SQL ({f.rows} rows)</summary><pre>{html.escape(fs.sql)}</pre>'
                     f"{_query_hint(roots, fs.name + '.sql')}</details></section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------- entry point


def build_report(roots: list[str | Path], out_dir: str | Path, *, figures: tuple[Figure, ...] = FIGURES) -> Report:
    """Query, draw and write the report of the runs under ``roots`` into ``out_dir``.

    Raises ``storage.errors.StorageError`` (one line) for a root that holds no run.
    """
    import pyarrow.csv as pacsv

    t0 = time.perf_counter()
    roots = [Path(r) for r in roots]
    sources, runs = _open_sources(roots)  # fails before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = {label: RUN_COLORS[i % len(RUN_COLORS)] for i, (label, _) in enumerate(runs)}

    named = get_query(TABLE_QUERY)
    table, _ = run_sql(sources, named.sql, {k: d for k, (d, _) in named.params.items()})
    table = table if table is not None else pa.table({"run_id": pa.array([], pa.string())})
    pacsv.write_csv(table, out / "table.csv")

    results = []
    for fs in figures:
        data, notes = run_sql(sources, fs.sql)
        res = FigureResult(fs, rows=0 if data is None else data.num_rows)
        png = out / f"{fs.name}.png"
        (out / f"{fs.name}.sql").write_text(fs.sql + ";\n", encoding="utf-8")
        if data is not None and data.num_rows:
            res.panels = plot_figure(fs, data, colors, png)
        if res.panels:
            res.png = png.name
            drawn = {p.title for p in res.panels}
            missing = [p.title for p in fs.panels if not p.each and p.title not in drawn]
            if missing:
                res.note = "No data for: " + ", ".join(missing) + "."
        else:
            png.unlink(missing_ok=True)  # a stale PNG of an earlier build must not be mistaken for this one
            res.note = f"{fs.no_data}" + (f" ({'; '.join(notes)})" if notes else "")
        results.append(res)

    all_problems = [p for s in sources for p in problems(s.con)]
    jobs, _ = run_sql(sources, JOBS_SQL)
    report = Report(out, out / "index.html", runs, results, table, 0.0, all_problems, jobs)
    report.index.write_text(render_html(report, roots, colors, named.sql), encoding="utf-8")
    report.seconds = time.perf_counter() - t0
    return report
