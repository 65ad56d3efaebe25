"""CPU seconds of the rollout stage with the plain KV cache against the mirrored one, interleaved in one process.

The rollout engine's ``kv_mirror`` (stages.engines.kv_mirror) switched off and on for alternate
rollout stages of one run (``stress``: the stress-world NVFP4 cell's W4A4 rollout, random init,
every response to the 47-token cap, as ``benchmarks/stress_step.py``; ``tiny``: the tiny
default's BF16 rollout, random init, 12-token cap), 1 thread, the same policy throughout (no
training between rollouts). The first round's generate calls are replayed with the other cache
and compared token for token and log-prob for log-prob before anything is timed. Figures, not a test:

    python benchmarks/kv_mirror.py [--world stress|tiny] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

COMMON = ["threads=1", "bootstrap.steps=0", "bootstrap.noisy_steps=0"]
COMMON += ["evaluation.interval=1000", "checkpoint.interval=1000"]
WORLDS = {
    "stress": ("stress-cpu", ["precision.train=nvfp4", "precision.rollout=nvfp4_w4a4"]),
    "tiny": ("tiny-cpu", ["precision.train=bf16", "precision.rollout=bf16"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", choices=sorted(WORLDS), default="stress")
    ap.add_argument("--rounds", type=int, default=5, help="timed rollouts per side (after one untimed round)")
    args = ap.parse_args()
    from fp8rl_core.host.cpu_env import pin_cpu_numerics
    from fp8rl_core.host.cpu_malloc import keep_freed_memory

    pin_cpu_numerics()
    keep_freed_memory()
    preset, overrides = WORLDS[args.world]
    times = run(preset, COMMON + overrides, args.rounds)
    plain, mirror = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.world}: rollout CPU s, medians of {args.rounds}: plain cache {plain:.3f}, mirrored {mirror:.3f}")
    print(f"  mirrored / plain = {mirror / plain:.3f}; plain {times[False]}; mirrored {times[True]}")


def _outputs(batch) -> list:
    return [(s.response_ids, s.response_logprobs, s.finish_reason) for s in batch.samples]


def run(preset: str, overrides: list[str], rounds: int) -> dict[bool, list[float]]:
    from flows.campaign.configuration import dump_config, load_config
    from flows.campaign.cpu_numerics import gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.context import open_run
    from stages.rollout import run_rollout
    from storage.run.layout import create_run

    cfg = load_config(preset, overrides)
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="kv-mirror-") as tmp:
        create_run(tmp, "s", config=dump_config(cfg))
        env, state = open_run(cfg, Path(tmp) / "s")
        engine, calls = env.engine, []
        generate = engine.generate
        engine.generate = lambda *a, **kw: calls.append((a, kw, generate(*a, **kw))) or calls[-1][2]
        try:
            with cpu_bf16_gemm(gemm_choice(cfg, env.device).kind, env.device):
                for r in range(rounds + 1):
                    for mirror in (False, True) if r % 2 else (True, False):
                        engine.kv_mirror = mirror
                        calls.clear()
                        c0 = time.process_time()
                        _, state = run_rollout(env, state, 2 * r + int(mirror) + 1)
                        if r:
                            times[mirror].append(round(time.process_time() - c0, 3))
                        else:
                            _check_replay(engine, generate, calls, other=not mirror)
        finally:
            env.close()
    return times


def _check_replay(engine, generate, calls: list, *, other: bool) -> None:
    engine.kv_mirror = other
    for args, kwargs, batch in calls:
        if _outputs(generate(*args, **kwargs)) != _outputs(batch):
            raise SystemExit("the mirrored KV cache changed a rollout: not bit-identical")
    print(f"checked: {len(calls)} generate call(s) bit-identical with kv_mirror={other}", flush=True)


if __name__ == "__main__":
    main()
