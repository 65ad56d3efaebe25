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
Figures, not a test:

    python benchmarks/step_path.py [--stage train|rollout|score] [--leaves] [--set KEY=VALUE ...]
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
    from flows.configuration import dump_config, load_config
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.layout import create_run

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=("rollout", "score", "train"), default="train")
    ap.add_argument("--leaves", action="store_true", help="show the calls into fp8rl_core/ and storage/ as stops")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    args = ap.parse_args()
    print(walk(args.stage, args.set, leaves=args.leaves).report())


if __name__ == "__main__":
    main()
