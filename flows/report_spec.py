"""What a report figure is: panels of one SQL query's columns (``flows.report_figures`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Panel:
    """One axes: the result columns matching ``columns`` (a regex, full match).

    ``each``: one panel per matching column, titled by the column name (for
    columns the SQL creates dynamically, such as one per benchmark or stage).
    ``labels``: legend text per column (default: the column name).
    """

    columns: str
    title: str = ""
    ylabel: str = ""
    each: bool = False
    labels: tuple[tuple[str, str], ...] = ()
    log_y: bool = False


@dataclass(frozen=True)
class Figure:
    """A figure: file stem ``name``, heading, caption, SQL, panels.

    ``no_data``: why the figure can be empty (shown when it is).
    ``markers``: draw points too (sparse series: evaluations, calibrations).
    """

    name: str
    title: str
    caption: str
    sql: str
    panels: tuple[Panel, ...]
    no_data: str = "no rows in these runs"
    markers: bool = False


# Edges of the token-entropy bins (nats), the same as stages/train.py's
# ENTROPY_BIN_EDGES so the figure and the trainer's per-bin metrics agree.
_ENTROPY_BINS_SQL = """\
-- Clip shares per token-entropy bin and step, from token_stats (every token on
-- shadow steps, a seeded sample on the others). Bins in nats: edit the CASE.
PIVOT (
    SELECT
        run_id,
        step,
        CASE WHEN entropy < 0.1 THEN 'H<0.1' WHEN entropy < 0.5 THEN '0.1-0.5'
             WHEN entropy < 1.0 THEN '0.5-1' WHEN entropy < 2.0 THEN '1-2' ELSE 'H>=2' END AS bin,
        avg(clipped_lower::INTEGER) AS lower,
        avg(clipped_upper::INTEGER) AS upper
    FROM token_stats
    WHERE entropy IS NOT NULL
    GROUP BY ALL
)
ON bin IN ('H<0.1', '0.1-0.5', '0.5-1', '1-2', 'H>=2')
USING first(lower) AS lower, first(upper) AS upper
ORDER BY run_id, step"""
