"""Diagnostics: hand-computed values and brute-force references."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fp8rl_core.signals.diagnostics import (
    clip_shares_by_sign,
    entropy_binned_clip_shares,
    garbled_components,
    garbled_score,
    is_garbled,
    nmae,
    noise_amplification,
    over_clipped_mask,
    under_clipped_mask,
)


def test_nmae_hand_computed():
    x, ref = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 4.0])
    assert nmae(x, ref, torch.ones(3)) == pytest.approx(2 / 6)
    assert nmae(x, ref, torch.tensor([True, True, False])) == pytest.approx(1 / 2)
    assert nmae(torch.tensor([1.0, float("nan")]), torch.tensor([2.0, 1.0]), torch.ones(2)) == pytest.approx(0.5)
    assert math.isnan(nmae(x, ref, torch.zeros(3)))
    assert nmae(torch.ones(2), torch.zeros(2), torch.ones(2)) == math.inf


def test_noise_amplification_hand_computed():
    lg = torch.log
    out = noise_amplification(
        lg(torch.tensor([[0.5, 0.2]])),
        lg(torch.tensor([[0.4, 0.2]])),
        lg(torch.tensor([[0.5, 0.25]])),
        lg(torch.tensor([[0.5, 0.2]])),
        torch.ones(1, 2),
    )
    # pi: |0.5-0.4| / 0.6; pi_old: 0.05 / 0.7; r8 = (1.0, 0.8), r16 = (0.8, 1.0): 0.4 / 1.8
    assert out["prob_nmae"] == pytest.approx(1 / 6, rel=1e-6)
    assert out["old_prob_nmae"] == pytest.approx(0.05 / 0.7, rel=1e-6)
    assert out["ratio_nmae"] == pytest.approx(2 / 9, rel=1e-6)
    assert out["amplification"] == pytest.approx(4 / 3, rel=1e-6)


def test_over_and_under_clipped_masks():
    r8 = torch.tensor([0.7, 0.9, 0.7, 0.9, 0.7])
    r16 = torch.tensor([0.85, 0.7, 0.7, 0.9, 0.85])
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(5, dtype=torch.bool)
    over = over_clipped_mask(r8, r16, adv, mask, eps_low=0.2, lower=0.8)
    under = under_clipped_mask(r8, r16, adv, mask, eps_low=0.2, lower=0.8)
    assert over.tolist() == [True, False, False, False, False]
    assert under.tolist() == [False, True, False, False, False]
    # lowering L to 0.65 removes the over-clipped token and adds an under-clipped one
    assert not over_clipped_mask(r8, r16, adv, mask, eps_low=0.2, lower=0.65).any()
    assert under_clipped_mask(r8, r16, adv, mask, eps_low=0.2, lower=0.65).tolist() == [False, True, True, False, False]


def test_clip_shares_by_sign_hand_computed():
    r = torch.tensor([0.7, 0.9, 1.5, 0.7, 1.5, 3.0])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 0.0])
    s = clip_shares_by_sign(r, adv, torch.ones(6), lower=0.8, upper=1.28)
    assert (s["n_neg"], s["n_pos"]) == (3.0, 2.0)
    assert s["neg_lower_share"] == pytest.approx(1 / 3) and s["neg_upper_share"] == pytest.approx(1 / 3)
    assert s["pos_lower_share"] == 0.5 and s["pos_upper_share"] == 0.5
    s = clip_shares_by_sign(r, -adv.abs(), torch.ones(6), lower=0.8, upper=1.28)
    assert math.isnan(s["pos_upper_share"])


def test_entropy_binned_clip_shares_hand_computed():
    entropy = torch.tensor([0.1, 0.5, 1.0, 2.0, 5.0])
    r = torch.tensor([0.7, 1.5, 1.0, 0.5, 0.1])
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0, -1.0])
    # edges [0, 1, 2]: the last bin includes 2.0; entropy 5.0 lies outside
    rows = entropy_binned_clip_shares(entropy, r, adv, torch.ones(5), lower=0.8, upper=1.28, edges=[0.0, 1.0, 2.0])
    assert [(row["bin_lo"], row["bin_hi"], row["n_tokens"]) for row in rows] == [(0.0, 1.0, 2.0), (1.0, 2.0, 2.0)]
    assert rows[0]["clipfrac_lower"] == 0.5 and rows[0]["clipfrac_upper"] == 0.5 and rows[0]["neg_lower_share"] == 1.0
    assert rows[1]["clipfrac_lower"] == 0.5 and rows[1]["clipfrac_upper"] == 0.0 and rows[1]["neg_lower_share"] == 0.5
    rows = entropy_binned_clip_shares(
        entropy, r, adv, torch.ones(5), lower=0.8, upper=1.28, edges=[0.0, 1.0, 2.0, 3.0, 4.0]
    )
    assert [row["n_tokens"] for row in rows] == [2.0, 1.0, 1.0, 0.0]  # now 2.0 opens bin [2, 3)
    assert math.isnan(rows[3]["clipfrac_lower"])  # empty bin
    with pytest.raises(ValueError, match="strictly increasing"):
        entropy_binned_clip_shares(entropy, r, adv, torch.ones(5), lower=0.8, upper=1.28, edges=[1.0, 1.0])


def _longest_repeat_bruteforce(text: str) -> int:
    best = 0
    for length in range(1, len(text)):
        subs = [text[i : i + length] for i in range(len(text) - length + 1)]
        if len(set(subs)) < len(subs):
            best = length
    return best


def test_repetition_matches_bruteforce():
    rng = random.Random(0)
    for _ in range(30):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(16, 60)))
        assert garbled_components(text)["repetition"] == pytest.approx(_longest_repeat_bruteforce(text) / len(text))


def test_garbled_score_hand_computed():
    assert garbled_score("") == 0.0
    assert garbled_components("abcabcabcabcabcabc")["repetition"] == pytest.approx(15 / 18)  # period 3
    assert garbled_components("1111")["repetition"] == 0.0  # shorter than min_len
    assert garbled_components("\x00\x01ab")["nonprintable"] == 0.5
    assert garbled_components("ok\ufffd\n")["nonprintable"] == 0.25  # newline is fine, U+FFFD is not
    # "theм表" mixes three scripts in one word; "foo" and "bar" are clean: 5 of 11 letters
    assert garbled_components("theм表 foo bar")["script_mixing"] == pytest.approx(5 / 11)
    assert garbled_components("привет world 世界")["script_mixing"] == 0.0  # one script per word


def test_is_garbled_separates_clean_from_garbage():
    clean = "First compute 12 * 7 = 84, then add 16 to get 100. The answer is \\boxed{100}."
    assert garbled_score(clean) < 0.2 and not is_garbled(clean)
    assert is_garbled("the the the the the the the the the the the the")
    assert is_garbled("\x00\x07\x1b\x02\x03 ok")
    assert is_garbled("аbcдefгhiж") is True  # one word alternating Cyrillic and Latin
    assert 0.0 <= garbled_score("\x00" * 40) <= 1.0
