"""A sweep cell whose setting a pilot chooses, by a rule written in the sweep file before any seed runs.

A decisive comparison often includes "the strongest alternative", and which one that is
must not be picked after looking at the seeds it is compared on. A sweep file states the
candidates, the pilot seeds and the rule; an axis label uses the choice by name::

    choose:
      strongest:
        rule: best-second-half-eval
        seeds: [100, 101]                          # pilot seeds, apart from the sweep's seeds
        overrides: {calibration.mode: standard}    # what every pilot cell runs besides its candidate
        candidates:
          token-tis: {algorithm.correction.mode: token-tis}
          icepop: {algorithm.correction.mode: icepop}
    axes:
      setting:
        fp8-strongest: {choose: strongest}         # the winner's overrides, applied here

The pilot's cells (``pilot-strongest.<candidate>.s<seed>``) are cells of the same sweep
directory, run first. Once every one has finished, the rule picks a candidate **once**:
``_choices/strongest.json`` records the winner, each candidate's figures, the rule, the
pilot cells and the code they ran on, and every later invocation reads that file, so
neither a code change nor a re-run can move the choice. Cells using a choice wait until
it is made (``--dry-run`` lists them as waiting).

Rules:

* ``best-second-half-eval``: the highest second-half evaluation accuracy (the mean of the
  evaluations at steps >= half the last evaluated step), averaged over the pilot seeds;
  candidates within ``tie`` points of the best go to the lower over-clipped share on the
  shadow steps, then to file order.
"""

from __future__ import annotations

import json
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from storage.layout import write_text_atomic

RULES = ("best-second-half-eval",)
CHOICES_DIR = "_choices"
CHOOSE_KEY = "choose"  # the override key an axis label uses a choice by


class ChoiceSpec(BaseModel):
    """One ``choose:`` entry of a sweep file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: str = Field(description=f"How the winner is picked: {', '.join(RULES)}.")
    seeds: list[int] = Field(min_length=1, description="Pilot seeds; each candidate runs once per seed.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted config key -> value, applied to every pilot cell."
    )
    candidates: dict[str, dict[str, Any]] = Field(
        min_length=2, description="Candidate label -> overrides; the winner's overrides replace {choose: NAME}."
    )
    tie: float = Field(0.5, ge=0, description="Points of second-half accuracy within which candidates tie.")

    @field_validator("rule")
    @classmethod
    def _rule(cls, v: str) -> str:
        if v not in RULES:
            raise ValueError(f"unknown rule {v!r}; rules: {', '.join(RULES)}")
        return v

    _seeds = field_validator("seeds")(classmethod(lambda cls, seeds: distinct_seeds(seeds)))


def distinct_seeds(seeds: list[int]) -> list[int]:
    """``seeds`` if none repeats (a sweep's and a pilot's seed lists)."""
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds repeat: {seeds}")
    return seeds


def pilot_prefix(name: str) -> str:
    return f"pilot-{name}"


def choice_path(sweep_dir: Path, name: str) -> Path:
    return Path(sweep_dir) / CHOICES_DIR / f"{name}.json"


def read_choices(sweep_dir: Path | None, names: list[str]) -> dict[str, dict]:
    """name -> the recorded choice (``_choices/<name>.json``) for the choices already made."""
    out = {}
    for name in names:
        path = choice_path(sweep_dir, name) if sweep_dir is not None else None
        if path is not None and path.is_file():
            out[name] = json.loads(path.read_text(encoding="utf-8"))
    return out


def candidate_figures(sweep_dir: Path, runs: dict[str, list[str]]) -> dict[str, dict]:
    """candidate -> its pilot figures: per-run second-half accuracy and over-clipped share, and their means."""
    from storage.catalog import connect, query

    every = [r for rs in runs.values() for r in rs]
    con = connect(sweep_dir, runs=every)
    evals = query(  # the campaign's own rows (the views hold variant 'main'), every benchmark alike
        con,
        "SELECT run_id, step, avg(value) AS acc FROM eval_scores WHERE metric = 'avg@k' "
        "GROUP BY run_id, step ORDER BY run_id, step",
    ).to_pylist()
    columns = {r["column_name"] for r in query(con, "DESCRIBE steps").to_pylist()}
    over = (
        query(
            con,
            "SELECT run_id, avg(overclipped_share) AS over FROM steps WHERE shadow "
            "AND overclipped_share IS NOT NULL GROUP BY run_id",
        ).to_pylist()
        if {"shadow", "overclipped_share"} <= columns
        else []  # no shadow step in any pilot run: the tie-break has nothing to compare
    )
    acc: dict[str, dict[int, float]] = {}
    for e in evals:
        acc.setdefault(e["run_id"], {})[int(e["step"])] = float(e["acc"])
    over_by = {o["run_id"]: float(o["over"]) for o in over}
    figures = {}
    for cand, rs in runs.items():
        half = {r: second_half(acc.get(r, {})) for r in rs}
        overs = {r: over_by.get(r) for r in rs}
        known_half = [v for v in half.values() if v is not None]
        known_over = [v for v in overs.values() if v is not None]
        figures[cand] = {
            "runs": rs,
            "second_half_eval": half,
            "overclipped_share": overs,
            "mean_second_half_eval": statistics.fmean(known_half) if known_half else None,
            "mean_overclipped_share": statistics.fmean(known_over) if known_over else None,
        }
    return figures


def second_half(acc_by_step: dict[int, float]) -> float | None:
    """Accuracy in points, averaged over the evaluations at steps >= half the last evaluated step."""
    if not acc_by_step:
        return None
    last = max(acc_by_step)
    return 100 * statistics.fmean(v for k, v in acc_by_step.items() if k >= last / 2)


def pick(spec: ChoiceSpec, figures: dict[str, dict]) -> str:
    """The winner under ``spec.rule`` (module docstring)."""
    order = list(spec.candidates)
    scored = [c for c in order if figures[c]["mean_second_half_eval"] is not None]
    if not scored:
        raise ValueError("no pilot cell has an evaluation: the rule has nothing to compare")
    best = max(figures[c]["mean_second_half_eval"] for c in scored)
    tied = [c for c in scored if figures[c]["mean_second_half_eval"] >= best - spec.tie]
    inf = float("inf")
    return min(tied, key=lambda c: (figures[c]["mean_overclipped_share"] or inf, order.index(c)))


def make_choice(sweep_dir: Path, name: str, spec: ChoiceSpec, runs: dict[str, list[str]], code: dict) -> dict:
    """Apply the rule to the finished pilot and record it in ``_choices/<name>.json``; returns the record."""
    figures = candidate_figures(sweep_dir, runs)
    winner = pick(spec, figures)
    record = {
        "choice": name,
        "winner": winner,
        "overrides": spec.candidates[winner],
        "rule": spec.rule,
        "tie": spec.tie,
        "seeds": spec.seeds,
        "candidates": figures,
        "code": code,
        "made_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = choice_path(sweep_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    return record


def choice_markdown(record: dict) -> str:
    """The pilot's table: one row per candidate, the winner marked."""
    lines = [
        f"### Pilot: {record['choice']} (rule {record['rule']}, seeds {record['seeds']})",
        "",
        "| candidate | 2nd-half eval % (mean) | per seed | over-clipped % (mean) |",
        "|---|---:|---|---:|",
    ]
    for cand, f in record["candidates"].items():
        mark = " **(chosen)**" if cand == record["winner"] else ""
        mean = f["mean_second_half_eval"]
        seeds = ", ".join("—" if v is None else f"{v:.1f}" for v in f["second_half_eval"].values())
        over = f["mean_overclipped_share"]
        lines.append(
            f"| {cand}{mark} | {'—' if mean is None else f'{mean:.1f}'} | {seeds} | "
            f"{'—' if over is None else f'{100 * over:.3f}'} |"
        )
    return "\n".join(lines) + "\n"


__all__ = [
    "CHOICES_DIR",
    "CHOOSE_KEY",
    "RULES",
    "ChoiceSpec",
    "choice_markdown",
    "choice_path",
    "make_choice",
    "pick",
    "pilot_prefix",
    "read_choices",
    "second_half",
]
