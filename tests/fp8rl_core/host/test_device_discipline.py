"""Host/device discipline: the train step run with every tensor tagged device or host.

Every test runs on one CPU, where a tensor "on the GPU" and one "on the host" are the
same thing, so an op mixing them (a crash on CUDA) passes silently. Under
``HostDeviceMode`` the policy, the batch moved to the step's device and everything
computed from them are device tensors, the rest host ones, and a mix raises naming
the op and the line. The three mixes this suite pins each failed on the trainer
before the fix:

* the subsampled shadow pass picked the shadowed rows of a micro-batch (host
  indices) with a device mask;
* BAPO bucketized the update's device ratios with a grid built on the host;
* a batch already on the device (the GPU script's) reached ``step_metrics`` beside
  the gathered host per-token tensors.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.calibration.bapo import bapo_bounds
from fp8rl_core.config.method import BapoConfig
from fp8rl_core.host.device_discipline import HostDeviceMixError, HostDeviceMode, to_device
from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.tasks.tiny_model import VOCAB_SIZE, build_tiny_model
from stages.trainer.optimizer import make_optimizer
from stages.trainer.types import TrainBatch
from stages.trainer.update import UpdateSpec, policy_update
from tests.conftest import micro_config
from tests.scaleout_common import ragged_batch

PRECISIONS = ["bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "nvfp4", "mxfp4"]


def _batch(cfg, seed: int = 0, prompt: int = 6) -> TrainBatch:
    """A host batch of the micro campaign's shape: prompts x samples rows, ragged responses."""
    n, r = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens
    return ragged_batch(n, prompt, r, vocab=VOCAB_SIZE, seed=seed)


def _setup(*overrides: str):
    cfg = micro_config(*overrides)
    torch.manual_seed(0)
    model = build_tiny_model(cfg.model)
    convert_for_training(model, cfg.precision.train)
    opt, sched = make_optimizer(model, cfg)
    return cfg, model, opt, sched


def _subset(n: int) -> torch.Tensor:
    rows = torch.zeros(n, dtype=torch.bool)
    rows[::3] = True
    return rows


def test_the_mode_tags_moves_and_names_the_mixing_line():
    lin = torch.nn.Linear(4, 4)
    with HostDeviceMode([lin]) as mode:
        x = torch.randn(3, 4)
        with pytest.raises(HostDeviceMixError, match=r"linear mixes host and device.*test_device_discipline.py:\d+"):
            lin(x)
        y = lin(to_device(x, "cpu"))
        assert mode.tag_of(y) == "device" and mode.tag_of(y.cpu()) == "host" and mode.tag_of(y) == "device"
        assert mode.tag_of(x) == "host"  # the move copied: the host original keeps its tag
        assert mode.tag_of(y[torch.tensor([0, 2])]) == "device"  # host indices into a device tensor: as CUDA
        y.sum().backward()
        assert mode.tag_of(lin.weight.grad) == "device"
        assert mode.tag_of(torch.zeros(2, device=y.device)) == "device" and mode.tag_of(torch.zeros(2)) == "host"
        assert float(y.detach().sum()) == float(y.detach().sum())  # reading a value to the host: a sync, not a mix
        with pytest.raises(HostDeviceMixError, match="__getitem__"):
            torch.arange(2)[to_device(torch.tensor([True, False]), "cpu")]


def test_subsampled_shadow_indexes_host_rows_with_host_masks():
    cfg, model, opt, sched = _setup("precision.train=bf16")
    batch = _batch(cfg)
    with HostDeviceMode([model]):
        spec = UpdateSpec(bounds=(0.8, 1.28), shadow=True, seed=0, shadow_rows=_subset(batch.size))
        res = policy_update(model, opt, sched, batch, cfg, spec)
    shadowed = torch.isfinite(res.logp_bf16).all(1)
    assert torch.equal(shadowed, _subset(batch.size))


def test_bapo_builds_its_grids_on_the_ratios_device():
    ratio = torch.exp(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 0.2)
    adv = torch.randn(4, 1, generator=torch.Generator().manual_seed(1)).expand(4, 6).contiguous()
    mask = torch.ones(4, 6)
    ref = bapo_bounds(ratio, adv, mask, BapoConfig())
    with HostDeviceMode():
        got = bapo_bounds(to_device(ratio, "cpu"), to_device(adv, "cpu"), to_device(mask, "cpu"), BapoConfig())
    assert (got.lower, got.upper, got.rho) == (ref.lower, ref.upper, ref.rho)


def test_bapo_update_passes_under_the_mode():
    cfg, model, opt, sched = _setup("precision.train=bf16", "calibration.mode=bapo")
    with HostDeviceMode([model]):
        res = policy_update(model, opt, sched, _batch(cfg), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0))
    assert res.row_bounds is not None and res.metrics["updates"] == 2.0


def test_a_batch_already_on_the_device_reaches_the_step_metrics_on_the_host():
    """The GPU script's step: batch moved to the device before the update, calibration after."""
    from gpu_check.train_step import step_and_calibrate

    cfg, model, opt, sched = _setup("precision.train=fp8_rowwise")
    with HostDeviceMode([model]):
        batch = _batch(cfg).to(next(model.parameters()).device)  # cpu:0 under the mode: the device
        res, cal, seconds = step_and_calibrate(model, opt, sched, batch, cfg)
    assert res.logp_bf16 is not None and 0.6 <= cal.lower <= 1.0 and seconds > 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_micro_campaign_step_passes_under_the_mode(precision):
    """π_old, full and subsampled shadow, BAPO updates, metrics and a calibration, every precision."""
    from fp8rl_core.calibration.calibrated_clipping import CalibratorState, StandardClip, calibrate
    from fp8rl_core.objective.losses import importance_ratio
    from stages.train import shadow_metrics

    cfg, model, opt, sched = _setup(f"precision.train={precision}", "calibration.mode=bapo")
    a = cfg.algorithm
    std = (1 - a.eps_low, 1 + a.eps_high)
    with HostDeviceMode([model]) as mode:
        for step, rows in enumerate((None, _subset(32))):
            batch = _batch(cfg, seed=step)
            spec = UpdateSpec(bounds=std, shadow=True, seed=step, shadow_rows=rows)
            res = policy_update(model, opt, sched, batch, cfg, spec)
            m = shadow_metrics(batch, res, std, std, a.tis_cap)
            ok = torch.isfinite(res.logp_bf16) & (batch.response_mask > 0)
            r8 = importance_ratio(res.logp_fp8, res.old_logp_fp8)
            r16 = importance_ratio(res.logp_bf16, res.old_logp_bf16)
            prev = CalibratorState.initial(eps_low=a.eps_low, eps_high=a.eps_high, config=cfg.calibration)
            cal = calibrate(
                r8,
                r16,
                batch.advantages[:, None].expand_as(r8),
                ok,
                standard=StandardClip(a.eps_low, a.eps_high, a.dual_clip),
                config=cfg.calibration,
                previous=prev,
            )
            assert m["ratio_nmae"] >= 0 and cal.lower > 0 and mode.tag_of(res.logp_fp8) == "host"
    assert mode.ops > 1000  # the step really ran under the mode
