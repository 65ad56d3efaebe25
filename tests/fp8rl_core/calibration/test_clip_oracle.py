"""The oracle clip mode (``calibration.mode: oracle``): every token's clip decision on its BF16 ratio.

Every mini-batch of every epoch, the trainer takes each token's clip decision on r16 = π_θ / π_old, both
BF16 forwards of the same master weights, against the standard bounds and the dual clip; the loss and its
gradient stay FP8's. These tests drive the trainer's phases directly on a tiny model (as
``tests/stages/trainer/test_train_phases.py`` does), check the decisions against BF16 ratios computed here on the same
tokens and bounds, the per-token loss against the FP8 standard run's, and that the settings a run cannot
take are refused when the config loads.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from integrity_helpers import cli, one_line_exit_2

from flows.campaign.configuration import ConfigError, load_config
from fp8rl_core.config.clip_mode_kinds import CLIP_MODE_KINDS, cost_warning, refusals
from fp8rl_core.objective import losses
from fp8rl_core.objective.losses import ppo_token_losses
from fp8rl_core.registered import CLIP_MODES
from stages.trainer.batch import check_world_size, split_rows
from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE
from stages.trainer.forward import ForwardSpec, policy_logprobs
from stages.trainer.minibatch import minibatch_update
from stages.trainer.old_logp import old_logprobs
from stages.trainer.optimizer import make_optimizer
from stages.trainer.types import TrainStep
from tests.scaleout_common import small_batch, small_cfg, small_model

MODE = "fp8_tensorwise"
ALGO = dict(eps_low=0.02, eps_high=0.02, dual_clip=1.05, lr=3e-3, ppo_epochs=2)  # tight: the FP8 noise decides


def _logprobs(model, rows, micros, *, shadow: bool = True) -> dict[int, torch.Tensor]:
    """BF16 (``shadow``) or FP8 log-probs of each micro-batch's rows, computed here on the weights as they are."""
    x, out = rows.local, {}
    with torch.no_grad():
        for r in micros:
            lp = policy_logprobs(model, x.input_ids[r], x.attention_mask[r], ForwardSpec(MODE, shadow=shadow))[0]
            out.update({int(i): lp[j] for j, i in enumerate(r)})
    return out


def _rows(by_row: dict[int, torch.Tensor], r: torch.Tensor) -> torch.Tensor:
    return torch.stack([by_row[int(i)] for i in r])


def _oracle_step(clip: str, model, **algo):
    cfg = small_cfg(MODE, calibration=clip, **{**ALGO, **algo})
    rows = split_rows(small_batch(n=32), cfg, seed=3, collective=SINGLE_PROCESS_COLLECTIVE,
                      device=torch.device("cpu"), shadow_rows=None)  # fmt: skip
    opt, sched = make_optimizer(model, cfg)
    bounds = (1 - cfg.algorithm.eps_low, 1 + cfg.algorithm.eps_high)
    decides = CLIP_MODE_KINDS.get(clip).decides_on_bf16
    return cfg, rows, TrainStep(model, opt, sched, cfg, SINGLE_PROCESS_COLLECTIVE, rows, bounds, False, None, None,
                                decides_on_bf16=decides)  # fmt: skip


def _expected_codes(r16, adv, mask, lower, upper, c) -> torch.Tensor:
    """The clip decisions written out from their definition (docs/method.md, "Clip metrics")."""
    m = mask > 0
    codes = torch.zeros(r16.shape, dtype=torch.int8)
    codes[m & (adv < 0) & (r16 < lower)] = 1
    codes[m & (adv > 0) & (r16 > upper)] = 2
    codes[m & (adv < 0) & (r16 > c)] = 3
    return codes


@pytest.mark.timeout(60)
def test_the_oracle_clips_exactly_the_tokens_the_bf16_ratios_and_bounds_clip_in_every_epoch() -> None:
    model = small_model(MODE)
    cfg, rows, step = _oracle_step("oracle", model)
    a = cfg.algorithm
    first = [r for k in range(rows.per_epoch) for r in rows.padded[k]]
    old16 = _logprobs(model, rows, first)  # π_old in BF16, on the step's starting weights
    old = old_logprobs(step)
    seen = {"clipped": 0, "kept": 0, "fp8_differs": 0, "epochs": set()}
    for k in range(len(rows.plan)):
        theta16 = _logprobs(model, rows, rows.padded[k])  # before this update, as the trainer must
        theta8 = _logprobs(model, rows, rows.padded[k], shadow=False)
        u = minibatch_update(step, old, k)
        old = u.old
        assert [r.tolist() for r, _ in u.decisions] == [r.tolist() for r in rows.padded[k]]
        for r, codes in u.decisions:
            r16 = torch.exp(_rows(theta16, r) - _rows(old16, r))
            want = _expected_codes(r16, old.adv_tok[r], old.mask[r], 1 - a.eps_low, 1 + a.eps_high, a.dual_clip)
            assert torch.equal(codes, want), f"update {k}: decisions differ from the BF16 ratios' on the same tokens"
            valid = old.mask[r] > 0
            seen["clipped"] += int((codes[valid] != 0).sum())
            seen["kept"] += int((codes[valid] == 0).sum())
            r8 = torch.exp(_rows(theta8, r) - old.old8[r])
            fp8 = _expected_codes(r8, old.adv_tok[r], old.mask[r], 1 - a.eps_low, 1 + a.eps_high, a.dual_clip)
            seen["fp8_differs"] += int((fp8 != codes)[valid].sum())
        seen["epochs"].add(u.epoch)
    # the check has teeth: both kinds of token, and FP8's own ratios would have decided otherwise somewhere
    assert seen["clipped"] > 0 and seen["kept"] > 0 and seen["fp8_differs"] > 0, seen
    assert seen["epochs"] == {0, 1}


def _recording_ppo(monkeypatch) -> list[dict]:
    """Every call of the registered ppo loss, recorded: its inputs and the loss it returned."""
    calls, ppo = [], losses.POLICY_LOSSES.get("ppo")

    def record(logp, old_logp, advantages, mask, spec):
        loss, metrics = ppo(logp, old_logp, advantages, mask, spec)
        kw = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        calls.append(dict(logp=logp.detach(), old=old_logp, adv=advantages, mask=mask, loss=float(loss.detach()), **kw))
        return loss, metrics

    monkeypatch.setitem(losses.POLICY_LOSSES._items, "ppo", record)
    return calls


def _token_losses(call: dict, decided: bool) -> torch.Tensor:
    """``[B, T]`` per-token loss (TIS weight included) of a recorded call; ``decided``: with its clip decisions."""
    ratio = torch.exp(call["logp"] - call["old"])
    mat = ppo_token_losses(ratio, call["adv"], lower=call["lower"], upper=call["upper"], dual_clip=call["dual_clip"],
                           clip_decision=call["clip_decision"] if decided else None)  # fmt: skip
    return mat * call["is_weights"]


@pytest.mark.timeout(60)
def test_the_per_token_loss_on_unclipped_tokens_is_the_fp8_standard_runs(monkeypatch) -> None:
    """π_old batched apart (the regime): in the first update the two runs start from the same weights, so FP8
    standard clipping and the oracle see the same FP8 tokens; the oracle's loss is FP8's on every token it does
    not clip, and its clipped tokens give their clipped term."""
    calls = _recording_ppo(monkeypatch)
    model = small_model(MODE)
    twin = copy.deepcopy(model)
    _, _, standard = _oracle_step("standard", twin, old_logp_micro_batch_size=8)
    cfg, rows, oracle = _oracle_step("oracle", model, old_logp_micro_batch_size=8)
    minibatch_update(standard, old_logprobs(standard), 0)
    ours = old_logprobs(oracle)
    ran = [minibatch_update(oracle, ours, 0)]
    ran.append(minibatch_update(oracle, ran[-1].old, 1))
    n_std = len(rows.padded[0])
    std_calls, oracle_calls = calls[:n_std], calls[n_std:]
    compared = clipped = 0
    for s_call, o_call in zip(std_calls, oracle_calls[:n_std]):  # the first update: the same weights
        assert torch.equal(s_call["logp"], o_call["logp"]) and torch.equal(s_call["old"], o_call["old"])
        valid = s_call["mask"] > 0
        std_codes = losses.clip_decisions(
            torch.exp(s_call["logp"] - s_call["old"]),
            s_call["adv"],
            s_call["mask"],
            lower=s_call["lower"],
            upper=s_call["upper"],
            dual_clip=s_call["dual_clip"],
        )
        both = valid & (std_codes == 0) & (o_call["clip_decision"] == 0)
        assert torch.equal(_token_losses(o_call, True)[both], _token_losses(s_call, False)[both])
        compared += int(both.sum())
    for o_call in oracle_calls:  # every update: unclipped tokens give FP8's unclipped term, clipped ones the bound's
        valid, codes = o_call["mask"] > 0, o_call["clip_decision"]
        ratio = torch.exp(o_call["logp"] - o_call["old"])
        mine = _token_losses(o_call, True)
        kept = valid & (codes == 0)
        assert torch.equal(mine[kept], (-o_call["adv"] * ratio * o_call["is_weights"])[kept])
        bound = {1: o_call["lower"], 2: o_call["upper"], 3: o_call["dual_clip"]}
        for code, b in bound.items():
            hit = valid & (codes == code)
            assert torch.allclose(mine[hit], (-o_call["adv"] * b * o_call["is_weights"])[hit])
            clipped += int(hit.sum())
        total = float(torch.where(valid, mine, torch.zeros_like(mine)).sum()) / o_call["global_token_count"]
        assert o_call["loss"] == pytest.approx(total, rel=1e-5, abs=1e-7)  # the trainer's loss is these tokens'
    assert compared > 0 and clipped > 0, (compared, clipped)


@pytest.mark.timeout(30)
def test_every_clip_mode_has_its_record_and_every_record_a_mode() -> None:
    assert set(CLIP_MODE_KINDS.names()) == set(CLIP_MODES.names())
    assert [m for m in CLIP_MODE_KINDS.names() if CLIP_MODE_KINDS.get(m).decides_on_bf16] == ["oracle"]


@pytest.mark.timeout(30)
def test_the_oracle_setting_is_validated_when_the_config_loads() -> None:
    cfg = load_config("regime-tiny-cpu", ["calibration.mode=oracle"])
    assert cfg.calibration.mode == "oracle" and refusals(cfg) == []
    with pytest.raises(ConfigError, match="unknown clip mode 'oracel'; valid: .*oracle"):
        load_config("regime-tiny-cpu", ["calibration.mode=oracel"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "sets, needle",
    [
        (["precision.train=bf16", "precision.rollout=bf16"], "precision.train bf16 is not quantized: there is nothing"),
        (["algorithm.loss=cispo"], "takes the clip decisions of the ppo loss only; algorithm.loss is cispo"),
        (["algorithm.loss=gspo"], "algorithm.loss is gspo"),
        (["calibration.shadow_target_error=0.05"], "leave calibration.shadow_target_error unset"),
        (["calibration.initial_lower=0.9"], "leave calibration.initial_lower and initial_upper unset"),
    ],
)
def test_a_combination_the_oracle_cannot_run_is_one_line_when_the_config_loads(sets, needle) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("regime-tiny-cpu", ["calibration.mode=oracle", *sets])
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    load_config("regime-tiny-cpu", ["calibration.mode=standard", *sets])  # the other settings alone load


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "precision.train=bf16", "--set", "precision.rollout=bf16"], "there is nothing to correct"),
        (["--nproc-per-node", "2"], "calibration.mode oracle runs in one process only"),
    ],
)
def test_a_combination_that_cannot_run_is_refused_before_the_run_folder_exists(tmp_path, args, needle) -> None:
    run_dir = tmp_path / "r"
    one_line_exit_2(cli("run", "regime-tiny-cpu", "--run-dir", run_dir, "--set", "calibration.mode=oracle", *args),
                    needle)  # fmt: skip
    assert not run_dir.exists()


@pytest.mark.timeout(30)
def test_several_ranks_are_refused_by_the_oracles_record_only() -> None:
    cfg = load_config("regime-tiny-cpu", ["calibration.mode=oracle"])
    check_world_size(cfg, 1)
    with pytest.raises(ValueError, match="runs in one process only"):
        check_world_size(cfg, 2)
    check_world_size(load_config("tiny-cpu", ["calibration.mode=standard", "algorithm.micro_batch_size=128"]), 2)


@pytest.mark.timeout(30)
def test_on_a_gpu_the_oracle_states_its_cost_in_one_line() -> None:
    cfg = load_config("regime-tiny-cpu", ["calibration.mode=oracle"])
    line = cost_warning(cfg, on_gpu=True)
    assert line is not None and len(line.splitlines()) == 1 and "BF16 forward of every micro-batch" in line
    assert cost_warning(cfg, on_gpu=False) is None
    assert cost_warning(load_config("regime-tiny-cpu", ["calibration.mode=standard"]), on_gpu=True) is None


SCREEN = ("fp8-rollout-only", "fp8-train-only", "fp8-old-together", "fp8-old-together-calibrated", "fp8-oracle",
          "fp8-rowwise", "fp8-blockwise", "fp8-geo-mask-calibrated")  # fmt: skip


CHOSEN = ("fp8-oracle", "fp8-old-together", "fp8-blockwise")  # the screen's choice: seven seeds
CONFIRMED = ("bf16", "fp8-standard", "fp8-oracle")  # fresh seeds 7-13: the one that closed the gap, and its pair


@pytest.mark.timeout(60)
def test_the_screen_runs_its_settings_on_two_seeds_beside_the_seven_seed_cells() -> None:
    from flows.sweep.spec import load_sweep

    _, cells = load_sweep("configs/sweeps/regime-seeds.yaml")  # every cell's config validated
    ids = {c.id: c for c in cells}
    for label in ("bf16", "fp8-standard", "fp8-calibrated"):  # the comparison's cells, under their own ids
        assert {f"{label}.s{s}" for s in range(7)} <= set(ids)
    assert set(CHOSEN) <= set(SCREEN)
    for label in SCREEN:
        seeds = list(range(14)) if label in CONFIRMED else list(range(7)) if label in CHOSEN else [0, 1]
        assert sorted(c.seed for c in cells if c.id.startswith(f"{label}.")) == seeds, label
    fresh = {c.id.split(".")[0] for c in cells if 7 <= c.seed <= 13}
    assert fresh == set(CONFIRMED)  # rule 4: only the settings under confirmation and their references
    oracle, standard = ids["fp8-oracle.s0"].config, ids["fp8-standard.s0"].config
    assert oracle.calibration.mode == "oracle" and oracle.algorithm == standard.algorithm
    assert ids["fp8-old-together.s1"].config.algorithm.old_logp_micro_batch_size is None
    assert standard.algorithm.old_logp_micro_batch_size == 256
    geo = ids["fp8-geo-mask-calibrated.s0"].config.algorithm.correction
    assert (geo.mode, geo.calibrate) == ("geo-mask", True)


@pytest.mark.timeout(60)
def test_the_long_horizon_adds_calibrated_the_oracle_and_each_half_of_fp8_on_the_same_seeds_and_200_steps() -> None:
    from flows.sweep.spec import load_sweep

    _, cells = load_sweep("configs/sweeps/regime-long.yaml")  # every cell's config validated
    by = {c.id: c for c in cells}
    labels = ("bf16", "fp8-standard", "fp8-calibrated", "fp8-oracle", "fp8-rollout-only", "fp8-train-only")
    assert set(by) == {f"{label}.s{s}" for label in labels for s in range(3)}
    rollout_only, train_only = by["fp8-rollout-only.s2"].config.precision, by["fp8-train-only.s2"].config.precision
    fp8 = by["fp8-standard.s2"].config.precision
    assert (rollout_only.rollout, rollout_only.train) == (fp8.rollout, "bf16") and fp8.train != "bf16"
    assert (train_only.rollout, train_only.train) == ("bf16", fp8.train) and fp8.rollout != "bf16"
    assert all(c.config.steps == 200 and c.config.evaluation.interval == 10 for c in cells)
    oracle, standard = by["fp8-oracle.s1"].config, by["fp8-standard.s1"].config
    assert (oracle.calibration.mode, by["fp8-calibrated.s1"].config.calibration.mode) == ("oracle", "calibrated")
    assert oracle.algorithm == standard.algorithm and oracle.precision == standard.precision


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "extra, needle",
    [
        ("exclude:\n  - {clip: calibrated, seed: [7]}\n", "exclude.0.seed: 7 is not a seed of the sweep; seeds: 0, 1"),
        ("exclude:\n  - {clip: calibrated, seed: [x]}\n", "exclude.0.seed: seeds are integers"),
        ("  seed:\n    a: {}\n", "'seed' cannot name an axis"),
    ],
)
def test_an_exclude_seed_is_checked_when_the_sweep_file_loads(tmp_path, extra: str, needle: str) -> None:
    from flows.sweep.spec import load_sweep

    text = "name: t\naxes:\n  clip:\n    standard: {calibration.mode: standard}\n    calibrated: {}\nseeds: [0, 1]\n"
    if extra.startswith("  "):  # an axis
        text = text.replace("seeds:", extra + "seeds:")
    else:
        text += extra
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_sweep(tmp_path / "s.yaml")
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    ok = text.replace("seed: [7]", "seed: [1]").replace("seed: [x]", "seed: 1")
    if ok != text:
        (tmp_path / "s.yaml").write_text(ok)
        assert [c.id for c in load_sweep(tmp_path / "s.yaml")[1]] == ["standard.s0", "standard.s1", "calibrated.s0"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("device, cuda, warned", [("auto", True, True), ("auto", False, False), ("cpu", True, False)])
def test_fp8rl_run_warns_in_one_line_where_the_oracle_runs_on_a_gpu(monkeypatch, capsys, device, cuda, warned):
    from flows.commands.run import _warn_clip_mode_cost

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = load_config("regime-tiny-cpu", ["calibration.mode=oracle", f"device={device}"])
    _warn_clip_mode_cost(cfg)
    err = capsys.readouterr().err
    assert err.splitlines() == ([f"warning: {cost_warning(cfg, on_gpu=True)}"] if warned else []), err
