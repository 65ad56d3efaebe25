"""Checkpoints: round trip of weights/optimizer/RNG/state, completeness, retention."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.checkpoints.retention import apply_retention
from storage.checkpoints.store import CheckpointState, load_checkpoint, save_checkpoint
from storage.checkpoints.verify import latest_complete, list_checkpoints, verify_checkpoint
from storage.errors import CheckpointError
from storage.run.layout import create_run


def tiny_model(seed: int = 0, tie: bool = True):
    from transformers import Qwen3ForCausalLM

    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, tie_word_embeddings=tie, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>"] + list("0123456789+-=* "))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    return create_run(tmp_path, "r").root


def _trained(seed: int = 0):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
    loss.backward()
    opt.step()
    return model, opt


def test_round_trip_everything(run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, opt = _trained()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(
        run_dir,
        7,
        model=model,
        tokenizer=tiny_tokenizer(),
        optimizer=opt,
        state=CheckpointState(
            sampler_state={"epoch": 1, "cursor": 42},
            calibrator_state={"lower": np.float32(0.75)},
            config={"seed": 0},
            metrics={"accuracy": 0.5},
            extra={"scheduler": {"last_epoch": 7}},
        ),
    )
    assert path == run_dir / "checkpoints" / "step_7"
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())

    # transformers loads the weights and the tokenizer directly
    loaded = AutoModelForCausalLM.from_pretrained(path / "model")
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    assert AutoTokenizer.from_pretrained(path / "model").convert_tokens_to_ids("7") == 9

    fresh, fresh_opt = _trained(seed=99)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ck = load_checkpoint(path, model=fresh, optimizer=fresh_opt, hashes=True)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    s1, s2 = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)
    assert ck.step == 7 and ck.sampler_state == {"epoch": 1, "cursor": 42}
    assert ck.calibrator_state == {"lower": pytest.approx(0.75)} and ck.config == {"seed": 0}
    assert ck.metrics == {"accuracy": 0.5} and ck.extra == {"scheduler": {"last_epoch": 7}}
    manifest = json.loads((path / "manifest.json").read_text())
    assert "model/model.safetensors" in manifest["files"] and "optimizer.pt" in manifest["files"]


def test_untied_model_round_trip(run_dir: Path) -> None:
    model = tiny_model(tie=False)
    path = save_checkpoint(run_dir, 1, model=model, rng_state=False)
    fresh = tiny_model(seed=5, tie=False)
    load_checkpoint(path, model=fresh)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert not (path / "rng.json").exists()


def test_incomplete_and_corrupt_checkpoints_are_skipped(run_dir: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(run_dir, step, rng_state=False, state=CheckpointState(calibrator_state={"step": step}))
    # step 3: a file changed after the manifest (bit rot); step 4: no manifest (half-written by hand)
    state = run_dir / "checkpoints" / "step_3" / "state.json"
    state.write_text(state.read_text().replace('"step": 3', '"step": 9'))
    (run_dir / "checkpoints" / "step_4").mkdir()
    (run_dir / "checkpoints" / ".tmp-step_5-abcd").mkdir()  # interrupted save: not even listed
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 2, 3, 4]
    assert "sha256 does not match" in verify_checkpoint(run_dir / "checkpoints" / "step_3")[0]
    assert verify_checkpoint(run_dir / "checkpoints" / "step_3", hashes=False) == []  # same size
    assert "no manifest.json" in verify_checkpoint(run_dir / "checkpoints" / "step_4")[0]
    assert latest_complete(run_dir) == run_dir / "checkpoints" / "step_2"
    assert latest_complete(run_dir, at_most=1) == run_dir / "checkpoints" / "step_1"
    with pytest.raises(CheckpointError, match="incomplete or corrupt"):
        load_checkpoint(run_dir / "checkpoints" / "step_3", hashes=True)
    with pytest.raises(CheckpointError, match="holds no model"):
        load_checkpoint(run_dir / "checkpoints" / "step_1", model=tiny_model())


def test_failed_save_leaves_nothing(run_dir: Path) -> None:
    class Exploding:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(run_dir, 1, model=Exploding())
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_resaving_a_step_sets_the_old_one_aside(run_dir: Path) -> None:
    save_checkpoint(run_dir, 2, rng_state=False, state=CheckpointState(metrics={"v": 1}))
    save_checkpoint(run_dir, 2, rng_state=False, state=CheckpointState(metrics={"v": 2}))
    assert load_checkpoint(run_dir / "checkpoints" / "step_2").metrics == {"v": 2}
    aside = run_dir / "superseded" / "checkpoints" / "step_2"
    assert json.loads((aside / "state.json").read_text())["metrics"] == {"v": 1}


def test_retention_keeps_last_k_and_best(run_dir: Path) -> None:
    acc = {1: 0.2, 2: 0.9, 3: 0.4, 4: 0.3, 5: 0.5}
    for step, a in acc.items():
        save_checkpoint(run_dir, step, rng_state=False, state=CheckpointState(metrics={"accuracy": a}))
    (run_dir / "checkpoints" / "step_0").mkdir()  # incomplete: left for doctor, never deleted
    removed = apply_retention(run_dir, keep_last=2, best_metric="accuracy")
    assert sorted(p.name for p in removed) == ["step_1", "step_3"]
    assert [s for s, _ in list_checkpoints(run_dir)] == [0, 2, 4, 5]
    removed = apply_retention(run_dir, keep_last=1, best_metric="accuracy", higher_is_better=False)
    assert [s for s, _ in list_checkpoints(run_dir)] == [0, 4, 5]  # lowest accuracy of the rest is step 4
