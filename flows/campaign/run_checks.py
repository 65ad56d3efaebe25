"""What ``fp8rl resume`` checks before it touches a run: that the run is the run it claims to be.

- **The config.** ``run.json`` records the hash of the config a run was created
  with (and, since this check, the config itself). ``config.yaml`` is the file a
  resumed run reads, so an edit there would silently mix two configs into one
  run. Resume compares the file with the record: the same text, or the same
  values written differently, pass; anything else is refused in one line that
  names the changed keys. ``--accept-config-change`` takes the edit on purpose:
  the change (keys, old and new hash, the steps done before it) is recorded in
  ``run.json`` and in the ledger, where ``doctor`` and ``query`` show it.
- **The arguments.** ``--from STAGE --step N`` sets outputs aside, so both are
  checked against the run first: N within the run's steps, and a STAGE the
  ledger recorded at step N.
- **The ledger.** A damaged record (not a torn one of a crash) is refused, the
  verdict ``doctor`` and ``query`` give the same line (``Ledger.damage``).

Nothing here writes, except :func:`record_config_change` on an accepted change.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from flows.campaign.configuration import dump_config
from fp8rl_core.config.campaign import CampaignConfig
from storage.run.identity import config_file_drift
from storage.run.layout import RunInfo, config_hash


class RunMismatch(ValueError):
    """The run directory does not hold what the command was asked to do; the message is one line."""


def config_drift(info: RunInfo, text: str, cfg: CampaignConfig) -> list[str] | None:
    """None if ``config.yaml`` (``text``, loaded as ``cfg``) is the config the run records, else the changes
    (``key (old -> new)`` items; one item naming the hashes for runs that recorded only the hash)."""
    want = info.current_config_hash
    if want is not None and config_hash(dump_config(cfg)) == want:
        return None  # the same values, written differently
    return config_file_drift(info, text, cfg.model_dump(mode="json"))


def drift_message(run_dir: Path, drift: list[str]) -> str:
    shown = "; ".join(drift[:6]) + (f"; and {len(drift) - 6} more" if len(drift) > 6 else "")
    return (
        f"{run_dir / 'config.yaml'} was edited since the run was made: {shown}; restore it, start a new run, "
        f"or take the change on purpose with `fp8rl resume {run_dir} --accept-config-change`"
    )


def check_acceptable_change(run_dir: Path, info: RunInfo, cfg: CampaignConfig) -> None:
    """Refuse (RunMismatch) a config edit the run's recorded rows cannot follow, before it is recorded.

    Score centering trains on the rollout engine's top-K log-probs stored with each step's rollouts
    (``stages.train.centering_tensors``). A resume trains its replayed steps again from those rows,
    so a new K (other than 0, off) fails there, and at every later resume, once any step was rolled out."""
    from storage.ledger.events import Ledger

    recorded = info.current_config
    before = ((recorded or {}).get("algorithm") or {}).get("score_centering_k", 0)
    after = cfg.algorithm.score_centering_k
    done = Ledger(run_dir).last_finished()
    if recorded is None or after in (0, before) or done is None or done[0] < 1:
        return
    raise RunMismatch(
        f"algorithm.score_centering_k ({before} -> {after}) cannot be taken into {run_dir}: its steps 1 to "
        f"{done[0]} were rolled out with {'no' if not before else f'the top-{before}'} log-probs, and score "
        f"centering with K={after} trains on the top-{after}; restore config.yaml, set it to 0 (off), "
        "or start a new run"
    )


def record_config_change(run_dir: Path, info: RunInfo, cfg: CampaignConfig, drift: list[str]) -> dict:
    """Record an accepted config change in ``run.json`` (``config_changes``) and in the ledger."""
    from storage.ledger.events import Ledger
    from storage.run.layout import update_run_info

    ledger = Ledger(run_dir)
    done = ledger.last_finished()
    change = {
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "from_hash": info.current_config_hash,
        "to_hash": config_hash(dump_config(cfg)),
        "keys": drift,
        "after_step": None if done is None else done[0],
        "config": cfg.model_dump(mode="json"),
    }
    update_run_info(run_dir, config_changes=[*info.config_changes, change])
    ledger.config_change({k: v for k, v in change.items() if k != "config"})
    return change


def check_resume_point(run_dir: Path, cfg: CampaignConfig, stage: str, step: int) -> None:
    """Refuse a ``--from STAGE --step N`` the run does not have (RunMismatch), before anything is set aside."""
    from storage.ledger.events import Ledger
    from storage.run.layout import stage_of_part

    if not 0 <= step <= cfg.steps:
        raise RunMismatch(f"--step {step}: the run has steps 0 to {cfg.steps}")
    recorded = sorted(
        {stage_of_part(s) for (n, s) in Ledger(run_dir).current() if n == step},
        key=lambda s: (s.rstrip("0123456789"), s),
    )
    if stage not in recorded:
        have = ", ".join(recorded) if recorded else "nothing yet"
        raise RunMismatch(
            f"--from {stage} --step {step}: the run has no {stage} at step {step} (recorded there: {have}); "
            f"`fp8rl query {run_dir} \"SELECT step, stage, status FROM ledger ORDER BY step\"` lists them"
        )


def check_ledger(run_dir: Path) -> None:
    """Refuse (RunMismatch) to resume a run whose ledger has a damaged record: the ledger's one reading,
    the same verdict ``doctor`` and ``query`` give."""
    from storage.ledger.events import Ledger

    ledger = Ledger(run_dir)
    damaged = [(line, what) for line, severity, what in ledger.damage() if severity == "error"]
    if damaged:
        line, what = damaged[0]
        more = f" (and {len(damaged) - 1} more line(s))" if len(damaged) > 1 else ""
        raise RunMismatch(
            f"{ledger.path}:{line}: {what}{more}; resume cannot tell what that stage did: restore the line, or "
            f"delete it to have that stage redone (`fp8rl doctor {run_dir}` names every such line)"
        )

