"""The method on synthetic log-probs: NMAE, its amplification in the ratio, one calibration.

Each token carries two log-probs (pi_theta and pi_old), and the low-precision pass adds
independent noise to both, so the ratio's error is larger than either probability's (about
sqrt(2) times here, where the two errors have equal size). One calibration then moves L below
1 - eps_low until FP8 clips as many negative-advantage tokens as BF16 does, and picks H so
that FP8's positive-to-negative balance meets BF16's. Definitions: docs/method.md.

    python benchmarks/method_example.py        # about 3 s on a CPU
"""

from __future__ import annotations

import torch

from fp8rl_core.calibration.calibrated_clipping import StandardClip, calibrate
from fp8rl_core.config.method import CalibrationConfig
from fp8rl_core.signals.diagnostics import nmae


def main() -> None:
    g = torch.Generator().manual_seed(0)
    n = 4000  # tokens
    logp16 = -torch.rand(n, generator=g) * 3  # BF16 log-probs of pi_theta
    old16 = logp16 + 0.15 * torch.randn(n, generator=g)  # BF16 log-probs of pi_old

    def noise() -> torch.Tensor:  # the low-precision pass's error on one log-prob
        return 0.05 * torch.randn(n, generator=g)

    logp8, old8 = logp16 + noise(), old16 + noise()
    r16 = torch.exp(torch.clamp(logp16 - old16, -20, 20))
    r8 = torch.exp(torch.clamp(logp8 - old8, -20, 20))
    adv = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    mask = torch.ones(n, dtype=torch.bool)
    res = calibrate(r8, r16, adv, mask, standard=StandardClip(0.2, 0.28), config=CalibrationConfig())
    prob, ratio = nmae(logp8.exp(), logp16.exp(), mask), nmae(r8, r16, mask)
    print(f"probability NMAE {prob:.4f}, ratio NMAE {ratio:.4f}, amplification {ratio / prob:.2f}")
    print(
        f"alpha {res.alpha:.4f}; FP8 share of A<0 tokens below 0.8 {res.lower_clip_share_fp8_before:.4f}, "
        f"below the new L {res.lower_clip_share_fp8_applied:.4f}"
    )
    print(f"raw L {res.raw_lower:.4f} -> L {res.lower:.4f}; raw H {res.raw_upper:.2f} -> H {res.upper:.2f}")
    print(
        f"balance: BF16 target {res.target_balance:.4f}, "
        f"FP8 before {res.balance_before:.4f}, after {res.balance_after:.4f}"
    )


if __name__ == "__main__":
    main()
