"""How much FP8 noise in pi_old moves each mismatch correction, and where calibrated thresholds put it.

For every shadow step of a run (BF16 pi_old next to the FP8 one) and every
registered correction (``fp8rl_core.objective.corrections``), the share of units
(tokens, or sequences) outside the correction's reference thresholds with BF16
pi_old, with FP8 pi_old, and with FP8 pi_old at the calibrated thresholds, and
those thresholds; means over the shadow steps.

    python benchmarks/correction_thresholds.py RUN_DIR
    python benchmarks/correction_thresholds.py --make DIR --steps 3 [--set key=value ...]

``--make`` first runs a campaign of ``--steps`` steps into DIR through the stages
(tiny-cpu preset, shadow passes every step, plus the ``--set`` overrides).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fp8rl_core.objective.corrections import CORRECTIONS, calibrate_correction  # noqa: E402


def make_run(run_dir: Path, steps: int, overrides: list[str]) -> None:
    from flows.campaign.configuration import dump_config, load_config
    from stages.calibrate import run_calibrate
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    cfg = load_config("tiny-cpu", [f"steps={steps}", "calibration.interval=1", *overrides])
    create_run(run_dir.parent, run_dir.name, config=dump_config(cfg))
    env, state = open_run(cfg, run_dir)
    try:
        for step in range(1, steps + 1):
            for stage in (run_rollout, run_score, run_train, run_calibrate):
                _, state = stage(env, state, step)
    finally:
        env.close()


def shadow_steps(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Per shadow step: ``[B, T]`` FP8 and BF16 pi_old, rollout log-probs and the shadowed-token mask."""
    from storage.queries.catalog import connect, query

    con = connect(run_dir)
    tok = query(
        con,
        "SELECT t.step, sample_id, position, old_logp_fp8, old_logp_bf16 FROM token_stats t "
        "JOIN steps s ON s.run_id = t.run_id AND s.step = t.step "
        "WHERE s.shadow = 1 AND old_logp_bf16 IS NOT NULL ORDER BY t.step, sample_id, position",
    ).to_pydict()
    roll = query(con, "SELECT step, sample_id, rollout_logp FROM rollouts").to_pylist()
    by = {(r["step"], r["sample_id"]): r["rollout_logp"] for r in roll}
    out = []
    steps = np.array(tok["step"])
    for s in np.unique(steps):
        idx = np.nonzero(steps == s)[0]
        sid = np.array(tok["sample_id"])[idx]
        pos = np.array(tok["position"])[idx].astype(np.int64)
        _, row = np.unique(sid, return_inverse=True)
        shape = (int(row.max()) + 1, int(pos.max()) + 1)
        t = {k: torch.zeros(shape, dtype=torch.float32) for k in ("old8", "old16", "rollout")}
        mask = torch.zeros(shape, dtype=torch.bool)
        for i, r, p in zip(idx, row, pos):
            t["old8"][r, p] = tok["old_logp_fp8"][i]
            t["old16"][r, p] = tok["old_logp_bf16"][i]
            t["rollout"][r, p] = by[(int(s), tok["sample_id"][i])][p]
            mask[r, p] = True
        out.append({**t, "mask": mask})
    return out


def table(steps: list[dict[str, torch.Tensor]], max_factor: float) -> list[dict]:
    from fp8rl_core.config.method import AlgorithmConfig

    rows = []
    for name in CORRECTIONS.names():
        a = AlgorithmConfig(correction={"mode": name, "calibrate": True, "max_factor": max_factor})
        res = [calibrate_correction(s["old8"], s["old16"], s["rollout"], s["mask"], a) for s in steps]
        mean = lambda f: float(np.mean([f(r) for r in res]))  # noqa: E731
        rows.append(
            {
                "correction": name,
                "units": mean(lambda r: r.units),
                "reference": f"[{res[0].reference_lower:.4g}, {res[0].reference_upper:.4g}]",
                "outside_bf16_%": 100 * mean(lambda r: r.outside_share_bf16),
                "outside_fp8_%": 100 * mean(lambda r: r.outside_share_fp8_before),
                "outside_fp8_calibrated_%": 100 * mean(lambda r: r.outside_share_fp8_after),
                "calibrated": f"[{mean(lambda r: r.lower):.4g}, {mean(lambda r: r.upper):.4g}]",
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", nargs="?", type=Path)
    p.add_argument("--make", type=Path, help="run a campaign into this directory first")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--max-factor", type=float, default=2.0)
    args = p.parse_args(argv)
    run_dir = args.make or args.run_dir
    if run_dir is None:
        p.error("give RUN_DIR or --make DIR")
    if args.make:
        make_run(args.make, args.steps, args.overrides)
    steps = shadow_steps(run_dir)
    if not steps:
        print(f"{run_dir}: no shadow step with BF16 log-probs", file=sys.stderr)
        return 2
    rows = table(steps, args.max_factor)
    print(f"{len(steps)} shadow step(s) of {run_dir}")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
