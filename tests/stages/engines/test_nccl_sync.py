"""``weight_sync: nccl`` with vLLM's real transfer engines (its CPU build, ``.venv-vllm``) and a gloo stand-in for NCCL.

Each test runs ``tests/nccl_sync_checks.py`` in the vLLM venv with
``FP8RL_TEST_NCCL_STANDIN=1`` in every process (``tests/vllm_site/sitecustomize.py``):
vLLM's ``NCCLTrainerWeightTransferEngine`` and ``NCCLWeightTransferEngine``, the packed
producer and consumer and the TCP rendezvous are vLLM's; only ``PyNcclCommunicator``
and the CUDA stream calls on its path are the stand-in's
(``tests/vllm_site/fp8rl_nccl_standin.py``). Whole campaigns that sync by NCCL are in
tests/stages/engines/test_vllm_http_real.py (to a real ``vllm serve``) and
tests/flows/campaign/test_vllm_campaign.py (to
vLLM's ``LLM`` with its own engine-core process, killed and resumed).

* two trainer ranks (FSDP2, gloo): one sender (rank 0 opens the endpoint and talks to the
  engine, rank 1 only gathers), one stream pass per sync, the worker holds the trainer's
  bf16 weights bit for bit after each sync, 2 bytes per element on the wire, and rank 1
  leaves a sync only once rank 0 has resumed the server; the stand-in's NCCL rules.
"""

from __future__ import annotations

import pytest

from tests.real_vllm import nccl_checks, require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def _vllm():
    require_vllm()


def test_several_trainer_ranks_have_one_sender_and_send_bf16_once_per_sync(tmp_path):
    result = nccl_checks("ranks", tmp_path, timeout=300)
    r0, r1 = result["rank0"], result["rank1"]
    assert r0["port"] == r1["port"] > 0  # rank 0 picked it, rank 1 was told
    assert (r0["opened"], r1["opened"]) == ([0], [])  # only rank 0 opened the trainer endpoint
    assert r0["is_sender"] and not r1["is_sender"] and r1["client_calls"] == []  # rank 1 never talked to the server
    one_sync = ["pause", "start_weight_update", "update_weights", "finish_weight_update", "repack_tied_head", "resume"]
    assert r0["client_calls"] == one_sync[:1] + ["init_weight_transfer_engine"] + one_sync[1:] + one_sync
    assert r0["init_info"]["world_size"] == 2 and r0["init_info"]["rank_offset"] == 1
    assert r0["held_equal"] == [True, True]  # what the worker loaded: the trainer's bf16 weights, bit for bit
    assert r0["update_dtypes"] == ["bfloat16"] and "lm_head.weight" not in r0["names"]  # tied: never sent
    for r in (r0, r1):  # one pass over the parameters per sync, one all-gather each: no gather to check names
        assert [(s["streams"], s["gathers"]) for s in r["per_sync"]] == [(1, len(r0["names"]))] * 2
    assert sum(r0["wire"].values()) == 2 * 2 * r0["sent_numel"]  # two syncs of bf16: 2 bytes per element
    for sync in range(2):  # rank 1 left its sync after rank 0 had resumed the server
        assert r1["per_sync"][sync]["left_at"] >= r0["resumed_at"][sync]
    rules = result["rules"]
    for said in (rules["0"], rules["1"]):  # both ranks are told the same, as NCCL's ranks would fail together
        assert said[0] == "GlooCommunicator" and said[1].startswith("fine: holds [0.0, 1.0, 2.0]")
        assert "not contiguous" in said[2] and "disagree" in said[3] and "disagree" in said[4]
        assert "out of range" in said[5] and "destroyed communicator" in said[6]

