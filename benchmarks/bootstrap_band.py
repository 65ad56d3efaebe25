"""Where the default tiny policy lands after its bootstrap: a figure, measured once, not a test.

The default tiny model, bootstrapped with the recommended lr and step cap (the defaults of
``BootstrapConfig``), must land in the band that leaves RL headroom (sampled accuracy inside
``BASE_BAND``) and still know the procedure (greedy at least as good as sampled, less a
3-point slack), and its exact-teacher phase must end by learning, not by its cap. ``fp8rl
run`` says so at run time when a bootstrap lands outside the band; this script trains one
from scratch (1,200 steps of the portable numerics on one thread, about 7 minutes on an idle
2-core AMD EPYC) into a temporary folder and prints the measured figures.

    python benchmarks/bootstrap_band.py

Exit 0 when every condition holds, 1 otherwise (the line says which).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    from fp8rl_core.config.model import BootstrapConfig, ModelConfig, TaskConfig
    from stages.bootstrap.math import BASE_BAND, EVAL_SIZE, bootstrap, read_meta

    with tempfile.TemporaryDirectory() as tmp:
        meta = read_meta(bootstrap(ModelConfig(), TaskConfig(), BootstrapConfig(), tmp))
    keys = ("base_accuracy_sampled", "base_accuracy_greedy", "switch_step", "total_steps", "train_seconds")
    print({k: meta[k] for k in keys})
    lo, hi = BASE_BAND
    checks = {
        f"eval size {EVAL_SIZE}": meta["eval_size"] == EVAL_SIZE,
        f"sampled accuracy inside [{lo}, {hi}]": lo <= meta["base_accuracy_sampled"] <= hi,
        "the exact phase ended by learning": meta["switch_step"] < meta["total_steps"],
        "greedy >= sampled - 0.03": meta["base_accuracy_greedy"] >= meta["base_accuracy_sampled"] - 0.03,
    }
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
