"""The vLLM engine against an honest stand-in: a real process boundary, vLLM 0.33's wire rules.

``tests/vllm_standin.py`` runs the engine core in a spawned process and
serializes every utility call as vLLM's engine core does
(``stages.engines.vllm_wire``). On the first version of the adapter
(``weight_sync="iterator"``: tensors through ``collective_rpc``) the weight sync
crashed here exactly as it would in vLLM; these tests check that every sync
mode now delivers every tensor, bit-exact and under its own name.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from vllm_standin import make_standin_module
from vllm_standin_core import STANDIN_GPU_UUID, param_digest

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
from stages.engines import SamplingRequest, make_engine
from stages.engines import vllm_engine as ve
from stages.engines import weight_transfer as wt
from stages.engines.vllm_options import VLLMHooks, VLLMSettings
from stages.engines.vllm_wire import MsgpackDecoder, MsgpackEncoder, UtilityOutput, UtilityResult, encode_utility_call

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- the wire
def test_untyped_engine_core_decoder_turns_tensors_into_bare_lists(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    big, small = torch.randn(8, 64, dtype=torch.bfloat16), torch.ones(2, 3)
    frames = encode_utility_call(
        MsgpackEncoder(),
        7,
        "collective_rpc",
        ("reload_weights", None, (), {"weights_iterator": [("a", big), ("b", small)]}),
    )
    assert len(frames) == 2  # the big tensor's bytes travel in their own frame ...
    client, call_id, method, (rpc, timeout, args, kwargs) = MsgpackDecoder().decode(frames)
    (name_a, a), (name_b, b) = kwargs["weights_iterator"]
    # ... and arrive as nobody's: [dtype, shape, frame index]; tuples became lists
    assert (client, call_id, method, rpc, args) == (0, 7, "collective_rpc", "reload_weights", [])
    assert name_a == "a" and a == ["bfloat16", [8, 64], 1]
    assert b[:2] == ["float32", [2, 3]] and isinstance(b[2], memoryview)
    # a typed decoder (as for EngineCoreRequest fields) would rebuild the tensor
    assert torch.equal(MsgpackDecoder(torch.Tensor).decode(MsgpackEncoder().encode(big)), big)
    # objects msgpack cannot carry are refused unless insecure serialization is on
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        MsgpackEncoder().encode({"handle": torch.float16})
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    assert MsgpackDecoder().decode(MsgpackEncoder().encode({"handle": torch.float16})) == {"handle": torch.float16}
    out = MsgpackDecoder(UtilityOutput).decode(MsgpackEncoder().encode(UtilityOutput(3, result=UtilityResult([1, 2]))))
    assert out.call_id == 3 and out.result.result == [1, 2]


def test_ipc_update_info_keeps_order_and_metadata():
    weights = [("w1", torch.zeros(2, 3, dtype=torch.bfloat16)), ("w0", torch.ones(4, dtype=torch.bfloat16))]
    info, keep = wt.ipc_update_info(weights, gpu_uuid="GPU-x", handle_fn=lambda t: ("h", t.shape[0]))
    assert info["names"] == ["w1", "w0"] and info["dtype_names"] == ["bfloat16", "bfloat16"]
    assert info["shapes"] == [[2, 3], [4]] and len(keep) == 2
    import base64

    assert pickle.loads(base64.b64decode(info["ipc_handles_pickled"])) == [{"GPU-x": ("h", 2)}, {"GPU-x": ("h", 4)}]
    with pytest.raises(ValueError, match="CUDA IPC needs CUDA tensors"):
        wt.cuda_ipc_handle(torch.zeros(2))
    assert wt.nccl_trainer_init_kwargs(rank=1, master_address="10.0.0.1", master_port=29555, workers=2) == {
        "rank": 1, "master_address": "10.0.0.1", "master_port": 29555, "world_size": 3
    }  # fmt: skip
    zeroed = {
        "l.qkv_proj.weight": "0",
        "l.qkv_proj.weight_scale": "0",
        "l.down_proj.weight": "0",
        "l.attn.k_scale": "0",
    }
    after = {"l.qkv_proj.weight": "1", "l.qkv_proj.weight_scale": "0", "l.attn.k_scale": "0"}
    assert wt.unreloaded_parameters(zeroed, after) == ["l.down_proj.weight", "l.qkv_proj.weight_scale"]


# ------------------------------------------------------- across the boundary
@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return build_tiny_model(ModelConfig())


def file_handle_fn(folder):
    """CPU stand-in for CUDA IPC handles: the tensor goes to a file the engine process reads."""
    counter = iter(range(10**6))

    def handle(t):
        path = os.path.join(folder, f"t{next(counter)}.pt")
        torch.save(t.clone(), path)
        return ("standin-file", path)

    return handle


def make(policy, tokenizer, sync, tmp_path, **options):
    ipc = {"ipc_handle_fn": file_handle_fn(str(tmp_path)), "gpu_uuid": STANDIN_GPU_UUID} if sync == "ipc" else {}
    return make_engine(
        "vllm",
        model=policy,
        tokenizer=tokenizer,
        precision=PrecisionConfig(rollout="fp8_per_tensor"),
        config=RolloutConfig(engine="vllm", sleep_between_steps=True, weight_sync=sync, vllm_process="separate"),
        settings=VLLMSettings(**options),
        hooks=VLLMHooks(vllm_module=make_standin_module(), **ipc),
    )


REQUEST = SamplingRequest(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=3)


def trainer_digests(model):
    return {name: param_digest(t) for name, t in wt.trainer_weights(model)}


def mismatched(engine, model):
    """Names whose bf16 bytes in the engine process differ from the trainer's (lost or misplaced tensors)."""
    mine, theirs = trainer_digests(model), engine.llm.collective_rpc("get_standin_digests")[0]
    return sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))


def test_weight_sync_crosses_the_process_boundary_bit_exact(policy, tokenizer, tmp_path, monkeypatch):
    """Both CPU-testable sync modes on one engine process (IPC first, then the path fallback)."""
    engine = make(policy, tokenizer, "ipc", tmp_path)
    try:
        # The first adapter's sync: tensors through collective_rpc arrive as bare lists.
        with pytest.raises(Exception, match="must be Tensor, not list"):
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": wt.trainer_weights(policy)})
        prompts = [[1, 5, 6], [1, 7]]
        before = engine.generate(prompts, REQUEST)
        engine.sleep()
        trained = build_tiny_model(ModelConfig())  # "after a training step": other weights, same names
        with torch.no_grad():
            for (_, p), (_, q) in zip(policy.named_parameters(), trained.named_parameters()):
                q.copy_(p + 0.05 * torch.randn_like(p))
        engine.load_weights(trained)  # first sync (IPC): verified with reset_weights + checksums
        assert engine.events == ["generate", "sleep:1", "wake:weights", "sync", "release_cache", "wake:kv_cache"]
        assert mismatched(engine, trained) == []
        assert engine.llm.collective_rpc("get_standin_warnings")[0] == []
        after = engine.generate(prompts, REQUEST)
        assert after.samples != before.samples

        engine.weight_sync, engine.verify_sync = "path", "always"  # the fallback, back to the original weights
        engine.load_weights(policy)
        assert mismatched(engine, policy) == []
        folder = engine.transport.folder
        assert os.path.basename(folder).startswith("fp8rl-weights-") and os.listdir(folder) == ["model.safetensors"]
        assert (
            engine.generate(prompts, REQUEST).samples
            == before.samples
        )

        # A sender that swaps two same-shape tensors is caught by the exact comparison above ...
        engine.weight_sync, engine.verify_sync = "ipc", "never"
        original = wt.ipc_update_info

        def swapping(weights, **kw):
            w = list(weights)
            i, j = [k for k, (n, _) in enumerate(w) if n.endswith("self_attn.q_proj.weight")][:2]
            w[i], w[j] = (w[i][0], w[j][1]), (w[j][0], w[i][1])
            return original(w, **kw)

        monkeypatch.setattr(wt, "ipc_update_info", swapping)
        engine.load_weights(trained)
        assert mismatched(engine, trained) == [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ]
        # ... and one that drops a whole layer's tensor leaves it un-reloaded: verify_sync names it.
        monkeypatch.setattr(
            wt,
            "ipc_update_info",
            lambda weights, **kw: original(
                [(n, t) for n, t in weights if n != "model.layers.1.mlp.down_proj.weight"], **kw
            ),
        )
        engine.verify_sync = "always"
        with pytest.raises(RuntimeError, match=r"un-reloaded.*layers\.1\.mlp\.down_proj"):
            engine.load_weights(trained)
    finally:
        engine.close()
    # a trainer that lost a tensor since the first sync is refused before anything is sent
    engine.sent_names.first = ["model.embed_tokens.weight", "model.norm.weight"]
    with pytest.raises(RuntimeError, match="lost"):
        engine.sent_names(["model.embed_tokens.weight"])


@pytest.mark.timeout(240)
def test_campaign_steps_sleep_after_rollout_and_wake_before_sync(tmp_path, monkeypatch):
    """A step and the next rollout of the stages with the vLLM engine (stand-in): rollout, sleep, train,
    wake, sync, rollout."""
    from conftest import micro_config, open_micro_run

    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train

    monkeypatch.setattr(ve, "import_vllm", make_standin_module)
    base = tmp_path / "base"  # an untrained tiny policy: no bootstrap needed to check the engine's life cycle
    build_tiny_model(ModelConfig()).save_pretrained(base)
    build_tokenizer().save_pretrained(base)
    cfg = micro_config(
        f"model.path={base}",
        "rollout.engine=vllm",
        "rollout.weight_sync=path",
        "rollout.vllm_process=separate",
        "precision.rollout=fp8_per_tensor",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=6",
        "algorithm.ppo_mini_batch_size=4",
        "algorithm.micro_batch_size=4",
    )
    env, state = open_micro_run(tmp_path, cfg)
    try:
        engine = env.engine
        assert isinstance(engine, ve.VLLMEngine) and engine.llm.kwargs["enable_sleep_mode"] is True
        with pytest.raises(
            Exception, match="Weight transfer not configured"
        ):  # path mode: no transfer engine, as in vLLM
            engine.llm.start_weight_update()
        _, state = run_rollout(env, state, 1)
        assert engine.asleep  # the trainer runs with the engine asleep
        _, state = run_score(env, state, 1)
        _, state = run_train(env, state, 1)
        run_rollout(env, state, 2)
        assert engine.events == [
            "sync",
            "generate",
            "sleep:1",  # step 1 (first load of the base policy)
            "wake:weights",
            "sync",
            "release_cache",
            "wake:kv_cache",
            "generate",
            "sleep:1",  # step 2: after step 1's update
        ]
        # the frontend's calls to vLLM, in order, around step 2's weight update
        calls = [c for c in engine.llm.calls if c[0] in ("sleep", "wake_up", "collective_rpc", "generate")]
        k = calls.index(("sleep", 1))
        assert calls[k + 1 : k + 6] == [
            ("wake_up", ["weights"]),
            ("collective_rpc", "reload_weights"),
            ("collective_rpc", "fp8rl_repack_tied_head"),  # a method of our worker extension, by name
            ("wake_up", ["kv_cache"]),
            ("generate", cfg.rollout.prompts_per_step),
        ]
    finally:
        env.close()
