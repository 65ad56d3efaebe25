"""What a report figure is: panels of one SQL query's columns (``flows.report.figures`` lists them)."""

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
