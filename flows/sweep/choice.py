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

from fp8rl_core.config.section import known_name
from storage.run.layout import write_text_atomic

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
        return known_name(v, "rule", RULES)

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


def read_choices(sweep_dir: Path | None, choose: dict[str, ChoiceSpec]) -> dict[str, dict]:
    """name -> the recorded choice (``_choices/<name>.json``) for the choices already made, each checked
    against the sweep file's ``choose`` entry (:func:`check_record`): a damaged record, or one made among
    other candidates or by another rule, is a ConfigError in one line, never read."""
    out = {}
    for name, spec in choose.items():
        path = choice_path(sweep_dir, name) if sweep_dir is not None else None
        if path is not None and path.is_file():
            out[name] = check_record(path, name, spec)
    return out


def check_record(path: Path, name: str, spec: ChoiceSpec) -> dict:
    """The choice record at ``path``, if it is whole and was made by what the sweep file says now.

    A choice is made once, before the seeds it is compared on: a record whose candidates, winner
    overrides, rule, tie or pilot seeds differ from the file's is refused, not re-made silently."""
    from flows.campaign.configuration import ConfigError

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        made = {
            "winner": str(record["winner"]),
            "overrides": dict(record["overrides"]),
            "rule": str(record["rule"]),
            "tie": float(record["tie"]),
            "seeds": [int(s) for s in record["seeds"]],
            "candidates": {str(c): [str(r) for r in f["runs"]] for c, f in dict(record["candidates"]).items()},
        }
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        why = err.strerror if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
        raise ConfigError(
            f"{path}: damaged choice record ({why}); restore it, or move it away to have choice {name} made "
            "again from its pilot"
        ) from None
    changed = [
        f"{what} {_listed(made[key])} (the file has {_listed(now)})"
        for what, key, now in (
            ("candidates", "candidates", list(spec.candidates)),
            ("rule", "rule", spec.rule),
            ("tie", "tie", spec.tie),
            ("pilot seeds", "seeds", list(spec.seeds)),
        )
        if _plain(list(made[key]) if key == "candidates" else made[key]) != _plain(now)
    ]
    if made["winner"] not in spec.candidates:
        changed.insert(0, f"its winner {made['winner']} is no longer a candidate")
    elif _plain(made["overrides"]) != _plain(spec.candidates[made["winner"]]):
        changed.insert(0, f"the overrides of its winner {made['winner']} differ from the file's")
    pilot = {c: [f"{pilot_prefix(name)}.{c}.s{s}" for s in spec.seeds] for c in spec.candidates}
    if not changed and made["candidates"] != pilot:
        changed.append("it names other pilot runs than the file's candidates and seeds give")
    if changed:
        raise ConfigError(
            f"{path}: choice {name} was made by another choose.{name} than the sweep file's now "
            f"({'; '.join(changed)}); a choice is made once: restore choose.{name}, or move the record away "
            "(or use another --out) to have it made again from its pilot"
        )
    return record


def _listed(value: Any) -> str:
    return ", ".join(str(v) for v in value) if isinstance(value, (list, dict)) else str(value)


def _plain(value: Any) -> str:
    """``value`` as canonical JSON: a record read back and the sweep file's values compare equal."""
    return json.dumps(value, sort_keys=True, default=str)


def candidate_figures(sweep_dir: Path, runs: dict[str, list[str]]) -> dict[str, dict]:
    """candidate -> its pilot figures: per-run second-half accuracy and over-clipped share, and their means."""
    from storage.queries.catalog import connect, query

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
