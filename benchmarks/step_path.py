"""The path of one stage call through the repository's files: its stops, files and returns.

How it is counted. One real step of the tiny default shrunk to seconds a step (one process,
mini-batches of one micro-batch as in the default, step 1 a calibration step: the shadow
passes run) runs its rollout,
score and train stages; the chosen stage runs under ``sys.settrace``. The walk starts in
the stage function (``stages/train.py:run_train``) and follows the Python calls into
``stages/`` and ``flows/``; a call into ``fp8rl_core/`` or ``storage/`` is a leaf (with
``--leaves`` it is a stop, and what it calls is not followed; without, it is not shown).
A function is followed the first time the step calls it, as a reader reads it once (a
loop's later rounds, and later calls from elsewhere, add nothing).

* a **stop**: the walk enters a function in another file, or comes back to the caller's
  file and runs more of it there (a call that ends its caller's work adds no stop);
* a **return**: a stop in a file already on the path; so ``returns = stops - files``.

Prints the path (one line per stop, ``↩`` marking a return) and the three counts. Run it
from another checkout's root with that checkout first on the path to walk its code alike.

``--from run_step`` counts instead the **hops** from the step's runner
(``flows/campaign/flow.py:run_step``) to each stage function (``stages/<stage>.py:run_<stage>``):
a two-step micro campaign runs as ``fp8rl run`` runs it (its Prefect flow, a temporary
Prefect server), and the first time each stage function is entered the frames between
``run_step`` and it that live in this repository are listed; each is a hop, the stage
function included (library frames, Prefect's task engine among them, are not counted but
shown as ``…``). Figures, not a test:

    python benchmarks/step_path.py [--stage train|rollout|score] [--leaves] [--set KEY=VALUE ...]
    python benchmarks/step_path.py --from run_step
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

FOLLOWED = ("stages", "flows")
LEAVES = ("fp8rl_core", "storage")
MICRO = [
    "steps=1",
    "bootstrap.steps=40",
    "bootstrap.noisy_steps=10",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=12",
    "algorithm.ppo_mini_batch_size=16",  # the default's shape: mini-batches of one micro-batch
    "algorithm.micro_batch_size=16",
    "calibration.interval=1",
    "evaluation.interval=1000",
    "checkpoint.interval=1000",
]


class PathWalk:
    """A ``sys.settrace`` hook that records the files one call goes through (see the module docstring)."""

    def __init__(self, root: Path, stage: str, *, leaves: bool) -> None:
        self.root, self.stage, self.leaves = root, stage, leaves
        self.state: dict = {}  # frame -> "followed" | "leaf" | "skipped"
        self.read: set = set()  # code objects already followed
        self.stops: list[tuple[str, str, bool]] = []  # (file, function, return)
        self.here: str | None = None

    def _package_file(self, code) -> tuple[str | None, str | None]:
        try:
            rel = Path(code.co_filename).resolve().relative_to(self.root)
        except ValueError:
            return None, None
        top = rel.parts[0]
        return (str(rel), top) if top in FOLLOWED + LEAVES else (None, None)

    def _caller(self, frame):
        """The nearest enclosing frame the walk knows, or None (outside the walked call)."""
        f = frame.f_back
        while f is not None and f not in self.state:
            f = f.f_back
        return f

    def _stop(self, file: str, name: str) -> None:
        if file != self.here:
            self.stops.append((file, name, any(s[0] == file for s in self.stops)))
            self.here = file

    def __call__(self, frame, event, arg):
        if event != "call":
            return None
        file, top = self._package_file(frame.f_code)
        if file is None:
            return None
        caller = self._caller(frame)
        if caller is None:
            if self.stops or frame.f_code.co_name != self.stage:
                return None
            self.state[frame] = "followed"
            self._stop(file, frame.f_code.co_qualname)
            return self._local
        if self.state[caller] != "followed" or frame.f_code in self.read:
            self.state[frame] = "skipped"
            return self._gone
        self.read.add(frame.f_code)
        if top in LEAVES:
            self.state[frame] = "leaf"
            if self.leaves:
                self._stop(file, frame.f_code.co_qualname)
            return self._gone
        self.state[frame] = "followed"
        self._stop(file, frame.f_code.co_qualname)
        return self._local

    def _local(self, frame, event, arg):
        if event == "line":
            file, _ = self._package_file(frame.f_code)
            self._stop(file, frame.f_code.co_qualname)
        elif event == "return":
            self.state.pop(frame, None)
        return self._local

    def _gone(self, frame, event, arg):
        if event == "return":
            self.state.pop(frame, None)
        return self._gone

    def report(self) -> str:
        lines = [f"{i}. {'↩ ' if back else ''}`{file}` — {name}" for i, (file, name, back) in enumerate(self.stops, 1)]
        files = len({s[0] for s in self.stops})
        returns = sum(1 for s in self.stops if s[2])
        lines.append(f"{len(self.stops)} stops in {files} files, {returns} returns")
        return "\n".join(lines)


def walk(stage_name: str, overrides: list[str], *, leaves: bool) -> PathWalk:
    """Run step 1 of the micro campaign up to ``stage_name`` and walk that stage's call."""
    import stages
    from flows.campaign.configuration import dump_config, load_config
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    order = {"rollout": run_rollout, "score": run_score, "train": run_train}
    cfg = load_config("tiny-cpu", MICRO + overrides)
    tracer = PathWalk(Path(stages.__file__).resolve().parent.parent, f"run_{stage_name}", leaves=leaves)
    with tempfile.TemporaryDirectory(prefix="step-path-") as tmp:
        create_run(tmp, "p", config=dump_config(cfg))
        env, state = open_run(cfg, Path(tmp) / "p")
        try:
            for name, stage in order.items():
                if name == stage_name:
                    sys.settrace(tracer)
                try:
                    _, state = stage(env, state, 1)
                finally:
                    sys.settrace(None)
                if name == stage_name:
                    break
        finally:
            env.close()
    return tracer


STAGE_FILES = ("rollout", "score", "train", "calibrate", "evaluate", "checkpoint")


def hops_from_run_step(overrides: list[str]) -> dict[str, list[str]]:
    """``stage -> [the repository's frames from run_step (excluded) to run_<stage> (included)]``,
    "…" marking a run of library frames, for the first call of each stage function."""
    import threading

    import stages
    from flows.campaign.configuration import dump_config, load_config
    from flows.campaign.flow import campaign_flow
    from storage.run.layout import create_run

    root = Path(stages.__file__).resolve().parent.parent
    targets = {f"stages/{s}.py:run_{s}": s for s in STAGE_FILES}
    found: dict[str, list[str]] = {}

    def where(frame) -> str | None:
        try:
            rel = Path(frame.f_code.co_filename).resolve().relative_to(root)
        except ValueError:
            return None
        if rel.parts[0] not in FOLLOWED + LEAVES:  # a virtualenv inside the checkout is library code
            return None
        return f"{rel}:{frame.f_code.co_name}"

    def profile(frame, event, arg):
        if event != "call":
            return
        here = where(frame)
        stage = targets.get(here or "")
        if stage is None or stage in found:
            return
        chain, f = [], frame
        while f is not None and f.f_code.co_name != "run_step":
            w = where(f)
            if w is None:
                if chain and chain[-1] != "…":
                    chain.append("…")
            else:
                chain.append(w)
            f = f.f_back
        found[stage] = list(reversed(chain)) if f is not None else ["(not reached from run_step in this thread)"]

    cfg = load_config("tiny-cpu", MICRO + ["steps=2", "evaluation.interval=2", "checkpoint.interval=2",
                                           "evaluation.benchmarks=[{name: synthetic, k: 1, limit: 8}]", *overrides])
    with tempfile.TemporaryDirectory(prefix="step-hops-") as tmp:
        run = create_run(tmp, "h", config=dump_config(cfg)).root
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            campaign_flow(str(run))
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    return found


def hops_report(found: dict[str, list[str]]) -> str:
    lines = []
    for stage in STAGE_FILES:
        chain = found.get(stage)
        if chain is None:
            lines.append(f"{stage}: not run")
            continue
        n = sum(1 for c in chain if c != "…")
        lines.append(f"{stage}: {n} hops: run_step → " + " → ".join(chain))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="start", choices=("run_step",), help="count the hops from run_step to each stage")
    ap.add_argument("--stage", choices=("rollout", "score", "train"), default="train")
    ap.add_argument("--leaves", action="store_true", help="show the calls into fp8rl_core/ and storage/ as stops")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    args = ap.parse_args()
    if args.start:
        print(hops_report(hops_from_run_step(args.set)))
        return
    print(walk(args.stage, args.set, leaves=args.leaves).report())


if __name__ == "__main__":
    main()
