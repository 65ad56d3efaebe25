"""The vLLM adapter's logic, on CPU, against a stand-in ``vllm`` module.

No GPU and no vLLM here: :class:`FakeLLM` and the ``SamplingParams`` and output records of
``tests/vllm_standin.py`` mirror the parts of vLLM 0.33's offline API the adapter uses
(``LLM(...)`` keyword arguments, ``generate`` returning ``RequestOutput``-like objects whose
``CompletionOutput``s carry ``index``, ``token_ids``, ``logprobs`` as
``{token_id: Logprob}`` per step and ``finish_reason``; ``sleep(level)``,
``wake_up(tags)``, ``collective_rpc``, ``reset_prefix_cache``). ``FakeLLM`` records
every call so the tests can check what the adapter asked of vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import types

import pytest
import torch

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.engines import SamplingRequest, VLLMEngine, make_engine
from stages.engines.vllm_options import VLLMHooks, VLLMSettings, build_llm_kwargs, import_vllm
from stages.engines.vllm_sampling import batch_from_request_outputs, prompt_seed
from stages.engines.weight_transfer import trainer_weights
from tests.vllm_standin import CompletionOutput as FakeCompletion
from tests.vllm_standin import Logprob as FakeLogprob
from tests.vllm_standin import RequestOutput as FakeRequestOutput
from tests.vllm_standin import SamplingParams as FakeSamplingParams

EOS = 2


# --------------------------------------------------------------- the stand-in
class FakeLLM:
    """Generates pseudo-random tokens from each child's seed (``seed + index``, as
    vLLM does); log-prob of step t is ``-(t + 1) / 10``. Completions come back in
    reverse index order, and each step's dict also holds a decoy token, to check
    that the adapter sorts and picks the sampled token."""

    def __init__(self, model, **kwargs):
        self.model, self.kwargs, self.calls, self.sleeping = model, kwargs, [], False
        self.weights_version = 0

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        assert not self.sleeping, "generate on a sleeping engine"
        assert isinstance(sampling_params, list) and len(sampling_params) == len(prompts)
        self.calls.append(("generate", len(prompts)))
        outs = []
        for r, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            assert set(prompt) == {"prompt_token_ids"}
            completions = []
            for i in range(sp.n):
                rng = random.Random((sp.seed + i) * 31 + self.weights_version)
                ids, reason = [], "length"
                for _ in range(sp.max_tokens):
                    ids.append(rng.randrange(3, 40) if rng.random() > 0.15 else EOS)
                    if ids[-1] == EOS:
                        reason = "stop"
                        break
                steps = [
                    {tok: FakeLogprob(-(t + 1) / 10, rank=2), 0: FakeLogprob(-0.01, rank=1)}
                    for t, tok in enumerate(ids)
                ]
                completions.append(FakeCompletion(i, ids, steps if sp.logprobs == 0 else None, reason))
            outs.append(FakeRequestOutput(str(r), prompt["prompt_token_ids"], completions[::-1]))
        return outs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.sleeping = True

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        if tags is None or "kv_cache" in tags:
            self.sleeping = False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method, kwargs))
        self.weights_version += 1

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def fake_vllm():
    return types.SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams)


@pytest.fixture(scope="module")
def policy():
    return build_tiny_model(ModelConfig())


def make(
    policy, tokenizer, fake_vllm, *, rollout="fp8_per_tensor", sleep=True, model_path=None, **options
) -> VLLMEngine:
    return make_engine(
        "vllm",
        model=policy,
        tokenizer=tokenizer,
        precision=PrecisionConfig(rollout=rollout),
        config=RolloutConfig(engine="vllm", sleep_between_steps=sleep, gpu_memory_utilization=0.4),
        model_path=model_path,
        settings=VLLMSettings(**{"weight_sync": "path", "verify_sync": "never", **options}),
        hooks=VLLMHooks(vllm_module=fake_vllm),
    )


# --------------------------------------------------------------- construction
@pytest.mark.parametrize(
    "rollout, quantization", [("bf16", None), ("fp8_per_tensor", "fp8_per_tensor"), ("fp8_per_block", "fp8_per_block")]
)
def test_llm_kwargs_map_our_config(rollout, quantization):
    kwargs = build_llm_kwargs(
        RolloutConfig(gpu_memory_utilization=0.3, tensor_parallel_size=2, sleep_between_steps=False),
        PrecisionConfig(rollout=rollout),
        model_path="/ckpt",
        seed=5,
        logprobs_mode="processed",
        max_model_len=512,
        llm_options={"enforce_eager": True},
    )
    assert kwargs == {
        "model": "/ckpt",
        "tokenizer": "/ckpt",
        "dtype": "bfloat16",
        "quantization": quantization,
        "gpu_memory_utilization": 0.3,
        "tensor_parallel_size": 2,
        "enable_sleep_mode": False,
        "seed": 5,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "stages.engines.vllm_worker_extension.FP8RLWorkerExtension",
        "max_model_len": 512,
        "enforce_eager": True,
    }
    for sync in ("ipc", "nccl"):
        kw = build_llm_kwargs(
            RolloutConfig(),
            PrecisionConfig(rollout=rollout),
            model_path="/c",
            seed=0,
            logprobs_mode="raw",
            weight_sync=sync,
        )
        assert kw["weight_transfer_config"] == {"backend": sync}
    raw = build_llm_kwargs(
        RolloutConfig(), PrecisionConfig(rollout=rollout), model_path="/c", seed=0, logprobs_mode="raw"
    )
    assert raw["logprobs_mode"] == "raw_logprobs" and "max_model_len" not in raw


def test_the_kv_cache_size_and_eager_mode_reach_vllm_from_the_config():
    """``rollout.kv_cache_gib`` becomes vLLM's ``kv_cache_memory_bytes`` (bytes, not GiB) and
    ``rollout.enforce_eager`` its ``enforce_eager``; unset, neither is passed (vLLM's own defaults)."""
    cfg = RolloutConfig(kv_cache_gib=0.0625, enforce_eager=True)
    kw = build_llm_kwargs(cfg, PrecisionConfig(), model_path="/c", seed=0, logprobs_mode="processed")
    assert kw["kv_cache_memory_bytes"] == 64 * 2**20 and kw["enforce_eager"] is True
    plain = build_llm_kwargs(RolloutConfig(), PrecisionConfig(), model_path="/c", seed=0, logprobs_mode="processed")
    assert "kv_cache_memory_bytes" not in plain and "enforce_eager" not in plain
    with pytest.raises(ValueError):
        RolloutConfig(kv_cache_gib=0)


def test_the_plan_reserves_the_engines_weights_and_its_set_cache_instead_of_the_memory_share():
    from flows.plan.measured import engine_reservation
    from flows.plan.memory import GiB
    from fp8rl_core.config.campaign import CampaignConfig

    share = CampaignConfig.model_validate({"rollout": {"engine": "vllm", "gpu_memory_utilization": 0.5}})
    sized = CampaignConfig.model_validate({"rollout": {"engine": "vllm", "kv_cache_gib": 8.0}})
    hf = CampaignConfig.model_validate({"rollout": {"engine": "transformers", "kv_cache_gib": 8.0}})
    weights = 16.0 * GiB
    assert engine_reservation(share, 140.0, weights) == 70.0 * GiB
    assert engine_reservation(sized, 140.0, weights) == 24.0 * GiB
    assert engine_reservation(hf, 140.0, weights) == 0.0


def test_engine_writes_the_policy_for_vllm_and_cleans_up(policy, tokenizer, fake_vllm):
    engine = make(policy, tokenizer, fake_vllm)
    assert isinstance(engine.llm, FakeLLM) and engine.llm.model == engine.model_path
    assert engine.llm.kwargs["quantization"] == "fp8_per_tensor" and engine.llm.kwargs["enable_sleep_mode"] is True
    files = set(os.listdir(engine.model_path))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert engine.eos_ids == frozenset({EOS})
    path = engine.model_path
    engine.close()
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1, 5]], SamplingRequest(n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0))


def test_given_model_path_is_used_and_kept(policy, tokenizer, fake_vllm, tmp_path):
    engine = make(policy, tokenizer, fake_vllm, model_path=tmp_path)
    assert engine.llm.model == str(tmp_path) and os.listdir(tmp_path) == []
    engine.close()
    assert tmp_path.exists()


def test_missing_vllm_gives_an_actionable_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"fp8rl\[gpu\]"):
        import_vllm()


# ------------------------------------------------------------------- generate
def test_generate_builds_one_seeded_request_per_prompt(policy, tokenizer, fake_vllm, monkeypatch):
    engine = make(policy, tokenizer, fake_vllm)
    seen = []
    original = FakeLLM.generate

    def spy(self, prompts, sampling_params=None, *, use_tqdm=True):
        seen.append((prompts, sampling_params, use_tqdm))
        return original(self, prompts, sampling_params, use_tqdm=use_tqdm)

    monkeypatch.setattr(FakeLLM, "generate", spy)
    engine.generate([[1, 5, 6], [1, 7]], SamplingRequest(n=3, temperature=0.8, top_p=0.95, max_new_tokens=9, seed=11))
    prompts, params, use_tqdm = seen[0]
    assert prompts == [{"prompt_token_ids": [1, 5, 6]}, {"prompt_token_ids": [1, 7]}] and use_tqdm is False
    for p, sp in enumerate(params):
        assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens, sp.logprobs, sp.detokenize) == (
            3,
            0.8,
            0.95,
            9,
            0,
            False,
        )
        assert sp.top_k == 0  # vLLM default: no top-k truncation
        assert sp.seed == prompt_seed(11, p, 3)
    # vLLM seeds child i of a request with seed + i: no two samples may share a stream.
    child_seeds = {prompt_seed(11, p, 3) + i for p in range(50) for i in range(3)}
    assert len(child_seeds) == 150


def test_stop_token_ids_reach_vllm(policy, tokenizer, fake_vllm, monkeypatch):
    """The chat template's end-of-turn (added to the policy's stop set) is a vLLM stop token, not a cut afterwards."""
    policy.generation_config.eos_token_id = [tokenizer.eos_token_id, 77]  # apply_stop_tokens, chat template
    try:
        engine = make(policy, tokenizer, fake_vllm)
    finally:
        policy.generation_config.eos_token_id = tokenizer.eos_token_id
    seen = []
    original = FakeLLM.generate
    monkeypatch.setattr(
        FakeLLM,
        "generate",
        lambda self, prompts, sp=None, *, use_tqdm=True: (
            seen.append(sp) or original(self, prompts, sp, use_tqdm=use_tqdm)
        ),
    )
    engine.generate([[1, 5, 6], [1, 7]], SamplingRequest(n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0))
    assert [sp.stop_token_ids for sp in seen[0]] == [sorted({tokenizer.eos_token_id, 77})] * 2
    child_seeds = {prompt_seed(11, p, 3) + i for p in range(50) for i in range(3)}
    assert len(child_seeds) == 150


def test_per_prompt_seeds_make_a_groups_samples_independent_of_its_call(policy, tokenizer, fake_vllm):
    """``SamplingRequest.seeds``: a prompt's group depends on its own seed, not on the call it rides in."""
    engine = make(policy, tokenizer, fake_vllm)
    args = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=8)
    both = engine.generate([[1, 5], [1, 6, 7]], SamplingRequest(seed=1, seeds=[40, 41], **args))
    alone = engine.generate([[1, 6, 7]], SamplingRequest(seed=2, seeds=[41], **args))
    assert [s.response_ids for s in both.group(1)] == [s.response_ids for s in alone.group(0)]
    assert both.group(0) != [dataclasses.replace(s, prompt_index=0) for s in both.group(1)]
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        engine.generate([[1, 5], [1, 6, 7]], SamplingRequest(seed=1, seeds=[40], **args))


def test_generate_returns_group_layout_with_sampled_token_logprobs(policy, tokenizer, fake_vllm):
    engine = make(policy, tokenizer, fake_vllm)
    request = SamplingRequest(n=4, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=3)
    batch = engine.generate([[1, 5], [1, 6, 7], [1]], request)
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [(p, i) for p in range(3) for i in range(4)]
    assert batch.engine == "vllm" and batch.precision == "fp8_per_tensor" and batch.wall_seconds > 0
    for s in batch.samples:
        # The decoy token 0 (rank 1) must never be reported in place of the sampled one.
        assert s.response_logprobs == pytest.approx([-(t + 1) / 10 for t in range(len(s.response_ids))])
        assert (s.finish_reason == "stop") == (s.response_ids[-1] == EOS)
        assert EOS not in s.response_ids[:-1] and len(s.response_ids) <= 8
    assert {s.finish_reason for s in batch.samples} == {"stop", "length"}
    again = engine.generate([[1, 5], [1, 6, 7], [1]], request)
    assert again.samples == batch.samples


def _completion(index, ids, reason, logprobs=True):
    steps = [{tok: FakeLogprob(-0.5)} for tok in ids] if logprobs else None
    return FakeCompletion(index, ids, steps, reason)


def test_conversion_truncates_after_eos_and_rejects_bad_outputs():
    eos = frozenset({EOS, 9})
    out = [FakeRequestOutput("0", [1], [_completion(1, [4, 9, 5], "length"), _completion(0, [4, 4], "length")])]
    batch = batch_from_request_outputs(out, n=2, eos_ids=eos, wall_seconds=1.0, engine="vllm", precision="bf16")
    assert [s.response_ids for s in batch.samples] == [[4, 4], [4, 9]]
    assert [s.finish_reason for s in batch.samples] == ["length", "stop"]
    assert batch.samples[1].response_logprobs == [-0.5, -0.5]

    def convert(completions, n=1):
        return batch_from_request_outputs(
            [FakeRequestOutput("0", [1], completions)],
            n=n,
            eos_ids=eos,
            wall_seconds=1.0,
            engine="vllm",
            precision="bf16",
        )

    with pytest.raises(RuntimeError, match="logprobs=0"):
        convert([_completion(0, [4], "length", logprobs=False)])
    with pytest.raises(RuntimeError, match="'abort'"):
        convert([_completion(0, [4], "abort")])
    with pytest.raises(RuntimeError, match="expected n=2"):
        convert([_completion(0, [4], "length")], n=2)
    bad = _completion(0, [4, 5], "length")
    bad.logprobs[1] = {6: FakeLogprob(-0.1)}
    with pytest.raises(RuntimeError, match="lack the sampled token 5"):
        convert([bad])


# -------------------------------------------------------- weights, sleep, wake
def test_trainer_weights_are_bf16_cpu_in_hf_names_without_tied_head(policy):
    weights = trainer_weights(policy)
    names = [name for name, _ in weights]
    assert "lm_head.weight" not in names and names[0] == "model.embed_tokens.weight"
    assert names.index("model.layers.0.mlp.down_proj.weight") < names.index("model.layers.1.self_attn.q_proj.weight")
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for _, t in weights)
    ref = policy.state_dict()["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16)
    assert torch.equal(dict(weights)["model.layers.1.mlp.up_proj.weight"], ref)


def test_colocated_step_cycle_sleep_reload_generate(policy, tokenizer, fake_vllm):
    engine = make(policy, tokenizer, fake_vllm, sleep_level=2)
    before = engine.generate([[1, 5]], SamplingRequest(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0))
    engine.sleep()
    engine.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1, 5]], SamplingRequest(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0))
    engine.load_weights(policy)
    calls = engine.llm.calls
    assert calls[1:3] == [("sleep", 2), ("wake_up", ["weights"])]
    assert calls[3][:2] == ("collective_rpc", "reload_weights") and set(calls[3][2]) == {"weights_path"}
    assert calls[4][:2] == ("collective_rpc", "fp8rl_repack_tied_head")  # tied head: re-processed after the reload
    assert calls[5:] == [("wake_up", ["kv_cache"]), ("reset_prefix_cache",)]
    assert engine.events == ["generate", "sleep:2", "wake:weights", "sync", "release_cache", "wake:kv_cache"]
    after = engine.generate([[1, 5]], SamplingRequest(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0))
    assert after.samples != before.samples  # the fake's outputs depend on the weights version


def test_wake_up_and_non_colocated_sleep(policy, tokenizer, fake_vllm):
    engine = make(policy, tokenizer, fake_vllm)
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    engine.load_weights(policy)  # awake: no wake_up calls
    assert [c[:2] for c in engine.llm.calls[3:]] == [("collective_rpc", "reload_weights"),
                                                     ("collective_rpc", "fp8rl_repack_tied_head"),
                                                     ("reset_prefix_cache",)]
    separate = make(policy, tokenizer, fake_vllm, sleep=False)
    separate.sleep()
    separate.wake_up()
    assert separate.llm.calls == []


def test_weight_sync_by_path_saves_then_reloads(policy, tokenizer, fake_vllm):
    engine = make(policy, tokenizer, fake_vllm, weight_sync="path")
    os.remove(os.path.join(engine.model_path, "model.safetensors"))
    engine.load_weights(policy)
    folder = engine.transport.folder
    assert ("collective_rpc", "reload_weights", {"weights_path": folder}) in engine.llm.calls
    # our own temporary folder (not the model's, not named after it), bf16 tensors
    assert folder != engine.model_path and os.path.basename(folder).startswith("fp8rl-weights-")
    from safetensors.torch import load_file

    saved = load_file(os.path.join(folder, "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert not os.path.exists(os.path.join(engine.model_path, "model.safetensors"))
    engine.close()
    assert not os.path.exists(folder)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"sleep_level": 3}, "sleep_level"),
        ({"weight_sync": "iterator"}, "bare lists"),
        ({"weight_sync": "nccl"}, "NCCL cannot group a process with itself"),
        ({"weight_sync": "nccl", "in_process": False}, "nccl_master"),
        ({"logprobs_mode": "logits"}, "logprobs_mode"),
    ],
)
def test_bad_options_are_rejected(policy, tokenizer, fake_vllm, options, match):
    with pytest.raises(ValueError, match=match):
        make(policy, tokenizer, fake_vllm, **options)


# ------------------------------------------------------------- SPMD layouts
@pytest.mark.parametrize(
    "layout, tp, expect",
    [
        ("per_rank", 1, {"tensor_parallel_size": 1, "data_parallel_size": 4}),
        ("per_rank", 2, {"tensor_parallel_size": 2, "data_parallel_size": 2}),
        ("shared_tp", 1, {"tensor_parallel_size": 4, "data_parallel_size": 1}),
    ],
)
def test_engine_per_rank_under_torchrun(policy, tokenizer, fake_vllm, monkeypatch, layout, tp, expect):
    from stages.engines.vllm_options import spmd_llm_options

    assert spmd_llm_options(RolloutConfig(), rank=0, world_size=1) == {}
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    engine = make_engine(
        "vllm",
        model=policy,
        tokenizer=tokenizer,
        precision=PrecisionConfig(rollout="bf16"),
        config=RolloutConfig(engine="vllm", data_parallel=layout, tensor_parallel_size=tp),
        settings=VLLMSettings(weight_sync="path", verify_sync="never"),
        hooks=VLLMHooks(vllm_module=fake_vllm),
    )
    assert engine.llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert {k: engine.llm.kwargs[k] for k in expect} == expect
    with pytest.raises(ValueError, match="does not divide"):
        spmd_llm_options(RolloutConfig(tensor_parallel_size=3), rank=0, world_size=4)


def test_memory_around_sleep_goes_to_the_steps_metrics(policy, tokenizer, fake_vllm, monkeypatch):
    from stages.engines import vllm_engine
    from stages.rollout import sleep_engine, sync_engine

    readings = iter([61.5, 3.25])
    monkeypatch.setattr(vllm_engine, "gpu_memory_used_gib", lambda: next(readings))
    engine = make(policy, tokenizer, fake_vllm)
    env = types.SimpleNamespace(engine=engine)
    state = types.SimpleNamespace(policy=policy, policy_version=0)
    sync_engine(env, state)
    assert sleep_engine(env) == {"rollout_gpu_gib_before_sleep": 61.5, "rollout_gpu_gib_after_sleep": 3.25}
    sync_engine(env, state)  # same policy version: no reload, but the engine must be awake to generate
    assert engine.events[-2:] == ["wake:weights", "wake:kv_cache"] and not engine.asleep
    monkeypatch.setattr(vllm_engine, "gpu_memory_used_gib", lambda: None)  # no CUDA: nothing recorded
    assert sleep_engine(env) == {}


def test_level_2_sleep_is_undone_by_a_weight_push_even_without_a_new_policy(policy, tokenizer, fake_vllm):
    """A DAPO refill round after the step's rollout: same policy version, but level 2 discarded the weights."""
    from stages.rollout import sync_engine

    engine = make(policy, tokenizer, fake_vllm, sleep_level=2)
    env = types.SimpleNamespace(engine=engine)
    state = types.SimpleNamespace(policy=policy, policy_version=3)
    sync_engine(env, state)
    engine.sleep()
    with pytest.raises(RuntimeError, match="discarded"):
        engine.wake_up()
    sync_engine(env, state)
    assert engine.events == ["sync", "sleep:2", "wake:weights", "sync", "release_cache", "wake:kv_cache"]
