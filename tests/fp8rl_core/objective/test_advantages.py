"""Advantage estimators and DAPO shaping: hand-computed values and loop references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from fp8rl_core.objective.advantages import (
    ADVANTAGE_ESTIMATORS,
    drgrpo_advantages,
    dynamic_sampling_mask,
    grpo_advantages,
    overlong_penalty,
)


def test_grpo_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 5.0])
    groups = torch.tensor([3, 3, 3, 7])
    adv = grpo_advantages(rewards, groups)
    # group 3: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = [(1 / 3) / (s + 1e-6), (-2 / 3) / (s + 1e-6), (1 / 3) / (s + 1e-6), 5.0 / (1.0 + 1e-6)]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_drgrpo_hand_computed():
    adv = drgrpo_advantages(torch.tensor([1.0, 0.0, 1.0, 5.0], dtype=torch.float64), torch.tensor([3, 3, 3, 7]))
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, torch.tensor([1 / 3, -2 / 3, 1 / 3, 5.0], dtype=torch.float64))


def test_equal_rewards_give_zero_and_int_rewards_become_float():
    adv = grpo_advantages(torch.tensor([2, 2, 2, 0, 1]), torch.tensor([0, 0, 0, 1, 1]))
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv[:3], torch.zeros(3))
    # group 1: mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(adv[3:], torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + 1e-6))


def _loop_grpo(rewards: list[float], groups: list[int], std_normalize: bool) -> list[float]:
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        by_group.setdefault(g, []).append(r)
    out = []
    for r, g in zip(rewards, groups):
        vals = by_group[g]
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.fmean(vals), statistics.stdev(vals)
        out.append((r - mean) / (std + 1e-6) if std_normalize else r - mean)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_vectorized_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=gen))
    groups = torch.randint(0, 9, (n,), generator=gen) * 7 - 20  # non-contiguous, negative ids too
    rewards = torch.randint(0, 3, (n,), generator=gen).double() + torch.rand(n, generator=gen).double() * (seed % 2)
    for std_normalize, name in ((True, "grpo"), (False, "drgrpo")):
        expected = torch.tensor(_loop_grpo(rewards.tolist(), groups.tolist(), std_normalize), dtype=torch.float64)
        torch.testing.assert_close(grpo_advantages(rewards, groups, std_normalize=std_normalize), expected)
        torch.testing.assert_close(ADVANTAGE_ESTIMATORS.get(name)(rewards, groups), expected)


def test_registry_and_errors():
    assert ADVANTAGE_ESTIMATORS.names() == ["drgrpo", "grpo"]
    with pytest.raises(KeyError, match="valid: drgrpo, grpo"):
        ADVANTAGE_ESTIMATORS.get("ppo")
    with pytest.raises(ValueError, match="same length"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        grpo_advantages(torch.zeros(3), torch.zeros(3))
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_dynamic_sampling_mask_hand_and_loop():
    rewards = torch.tensor([1.0, 1.0, 1.0, 5.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([3, 3, 3, 7, 8, 8, 8])
    assert dynamic_sampling_mask(rewards, groups).tolist() == [False, False, False, False, True, True, True]
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        groups = torch.randint(0, 6, (40,), generator=gen)
        rewards = torch.randint(0, 2, (40,), generator=gen).float()
        keep = dynamic_sampling_mask(rewards, groups).tolist()
        for i, g in enumerate(groups.tolist()):
            vals = {r for r, gg in zip(rewards.tolist(), groups.tolist()) if gg == g}
            assert keep[i] == (len(vals) > 1)


def test_overlong_penalty_hand_computed():
    pen = overlong_penalty(torch.tensor([10, 20, 21, 22, 24, 30]), max_len=24, cache_len=4, factor=1.0)
    # zero up to 24 - 4 = 20 tokens, then -(len - 20) / 4
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -2.5]))
    assert not torch.signbit(pen[:2]).any()
    pen = overlong_penalty(torch.tensor([22.0]), max_len=24, cache_len=4, factor=0.5)
    torch.testing.assert_close(pen, torch.tensor([-0.25]))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, cache_len=5)


def test_dapo_filter_uses_accuracy_not_shaped_reward():
    """Score stage: an all-correct group whose overlong penalties differ is dropped; a mixed group is kept."""
    from types import SimpleNamespace

    import pyarrow as pa

    from flows.campaign.configuration import load_config
    from stages.score import _score_rows

    cfg = load_config(
        "tiny-cpu",
        [
            "rollout.samples_per_prompt=4",
            "algorithm.dynamic_sampling=true",
            "algorithm.overlong_shaping=true",
            "algorithm.overlong_max_len=12",
            "algorithm.overlong_cache_len=4",
        ],
    )
    rows = pa.table(
        {
            "sample_id": pa.array(range(12), pa.int32()),
            # group 0: all correct, lengths 5, 9, 11, 12 -> penalties 0, -0.25, -0.75, -1: rewards differ
            # group 1: mixed accuracy; group 2: all wrong, different lengths
            "response_length": pa.array([5, 9, 11, 12, 5, 6, 7, 8, 5, 10, 11, 12], pa.int32()),
        }
    )
    scores = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    cols = _score_rows(SimpleNamespace(cfg=cfg), rows, scores)
    assert len(set(cols["reward"][:4].tolist())) == 4 and len(set(cols["reward"][8:].tolist())) > 1
    assert cols["kept"].tolist() == [False] * 4 + [True] * 4 + [False] * 4
