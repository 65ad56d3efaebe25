"""The project's ``vllm`` engine on a real vLLM (the CPU build), BF16, on a tiny policy.

One engine for the whole module: tests/vllm_real_checks.py runs every check in
the vLLM venv against a single :class:`~stages.engines.vllm_engine.VLLMEngine`
and writes a JSON result; the tests below assert on it. Skipped, with the
reason, where the CPU build cannot run (not x86-64, no AVX2, no ``.venv-vllm``).
"""

from __future__ import annotations

import pytest

from tests.real_vllm import require_vllm, run_checks

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    require_vllm()
    return run_checks("engine", tmp_path_factory.mktemp("vllm-engine"))


def test_colocated_engine_runs_in_the_trainers_process(checks):
    """Colocated means in-process: vLLM's in-process client, no engine-core process to cross."""
    assert checks["client"] == "InprocClient"


def test_seeds_make_generation_reproducible_and_per_prompt(checks):
    seeds = checks["seeds"]
    assert seeds["repeat_identical"], "the same seeds gave other samples or log-probs"
    assert seeds["other_seeds_differ"]
    assert seeds["group_independent_of_call"], "a prompt's samples depended on the other prompts of the call"
    assert seeds["children_distinct"], "the n samples of one prompt were identical (shared seed)"
    assert seeds["layout_ok"]


def test_sampled_logprobs_match_the_trainers_bf16_recomputation(checks):
    lp = checks["logprobs"]
    assert 0 <= lp["sampled_gap"] <= lp["tolerance"], lp


def test_stop_tokens_reach_vllm_and_end_of_turn_stops_generation(checks):
    stops = checks["stops"]
    assert stops["stopped_samples"] >= 1, "no sample contained the chosen stop token: the check proves nothing"
    assert stops["end_at_stop_token"]
    assert stops["prefix_logprobs_equal"]
    assert stops["vllm_stopped_itself"], "vLLM generated past the stop token (stop_token_ids not passed)"
    assert stops["eos_finish_stop"]


def test_top_k_logprobs_for_score_centering_leave_the_samples_alone(checks):
    top = checks["top_k"]
    assert top["samples_unchanged"], "asking vLLM for top-k log-probs changed the samples or their log-probs"
    assert top["four_each"] and top["sorted"] and top["sampled_consistent"], top
    # the check's random tiny policy is nearly uniform (8 of 108 sampled tokens ranked in the top 4 here,
    # 2026-12-03): enough that the equality of the sampled token's two log-probs was checked at all
    assert top["sampled_in_top"] >= 1, f"no sampled token ranked in the top 4: the check proves nothing: {top}"


def test_weight_sync_after_a_training_step_gives_the_trainers_new_logprobs(checks):
    ws = checks["weight_sync"]
    tol = ws["tolerance"]
    assert ws["before_gap"] <= tol, ws
    assert ws["after_gap"] <= tol, f"engine log-probs after the sync differ from the trainer's: {ws}"
    assert ws["moved"] > 10 * tol, f"the sync did not change the engine's log-probs: {ws}"
    assert ws["events"][-1] == "sync"
