"""Real checkpoints and chat templates ( part 2), with nothing downloaded.

A random-init ``Qwen3ForCausalLM`` is saved with a tokenizer that carries a
Qwen-style chat template (``<|im_start|>role\\n…<|im_end|>``) and, like many
checkpoints, an EOS (``<|endoftext|>``) that is *not* the end-of-turn token.
Loaded through ``model.path``'s loader, the prompt ids must equal
``apply_chat_template``'s, generation must stop at ``<|im_end|>``, and grading
must read the answer out of a chat reply.
"""

from __future__ import annotations

import string
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.model import PromptConfig
from fp8rl_core.config.pipeline import RolloutConfig

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _save_checkpoint(path: Path, *, template: bool = True) -> Path:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
        clean_up_tokenization_spaces=False,
    )
    if template:
        tok.chat_template = QWEN_TEMPLATE
    torch.manual_seed(0)
    config = tiny_qwen3_config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"], bos_token_id=None,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # make the end-of-turn token common in random replies
        model.lm_head.weight[vocab["<|im_end|>"]] *= 6
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory) -> Path:
    return _save_checkpoint(tmp_path_factory.mktemp("ckpt") / "Qwen3-tiny-Instruct")


def _load(path: Path):
    from fp8rl_core.tasks.tiny_model import load_policy

    return load_policy(path)


def test_prompt_ids_equal_apply_chat_template(chat_ckpt):
    from stages.data.benchmarks import BOXED_INSTRUCTION
    from stages.data.prompt_format import formatter

    policy, tok = _load(chat_ckpt)
    cfg = PromptConfig(system_prompt="You are a careful mathematician.")
    f = formatter(cfg, tok, policy)
    assert f.mode == "chat"  # auto: an instruct checkpoint with a template
    prompt = f"What is 6*7? {BOXED_INSTRUCTION}"
    want = tok.apply_chat_template(
        [{"role": "system", "content": "You are a careful mathematician."}, {"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
    )
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert f.encode(prompt) == want
    assert tok.decode(want).endswith("<|im_start|>assistant\n")
    custom = formatter(PromptConfig(instruction="Answer with a number only."), tok, policy)
    assert tok.decode(custom.encode(prompt)).count("Answer with a number only.<|im_end|>") == 1
    plain = formatter(PromptConfig(format="plain"), tok, policy)
    assert plain.encode(prompt) == tok(prompt)["input_ids"]


def test_auto_uses_plain_text_for_base_checkpoints_and_templateless_tokenizers(tmp_path):
    from stages.data.prompt_format import formatter

    base = _save_checkpoint(tmp_path / "Qwen3-tiny-Base")
    policy, tok = _load(base)
    assert formatter(PromptConfig(), tok, policy).mode == "plain"
    assert formatter(PromptConfig(format="chat"), tok, policy).mode == "chat"
    bare = _save_checkpoint(tmp_path / "tiny-chat-less", template=False)
    policy, tok = _load(bare)
    assert formatter(PromptConfig(), tok, policy).mode == "plain"
    with pytest.raises(ValueError, match="no chat template"):
        formatter(PromptConfig(format="chat"), tok, policy)


def _generate(policy, tok, prompt_cfg: PromptConfig):
    from stages.data.prompt_format import apply_stop_tokens, encode_prompts
    from stages.engines import SamplingRequest, make_engine

    apply_stop_tokens(policy, tok, prompt_cfg)
    rcfg = RolloutConfig(max_new_tokens=48, generation_batch_size=64)
    engine = make_engine(
        "transformers",
        model=policy,
        tokenizer=tok,
        precision=PrecisionConfig(train="bf16", rollout="bf16"),
        config=rcfg,
    )
    env = SimpleNamespace(cfg=SimpleNamespace(prompt=prompt_cfg), tokenizer=tok)
    ids = encode_prompts(env, [f"What is {a}+{a}?" for a in range(8)], SimpleNamespace(policy=policy))
    return engine.generate(ids, SamplingRequest(n=4, temperature=1.0, top_p=1.0, max_new_tokens=48, seed=3)).samples


def test_generation_stops_at_the_end_of_turn_token(chat_ckpt):
    policy, tok = _load(chat_ckpt)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id
    samples = _generate(policy, tok, PromptConfig())
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert len(stopped) >= 4
    for s in samples:
        assert im_end not in s.response_ids[:-1]  # nothing generated after an end of turn
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in (im_end, tok.eos_token_id)
    assert any(s.response_ids[-1] == im_end for s in stopped)

    # the check can fail: without the template's stop token the model talks past its turn
    policy, tok = _load(chat_ckpt)
    samples = _generate(policy, tok, PromptConfig(format="plain"))
    assert any(im_end in s.response_ids[:-1] for s in samples)


def test_grading_extracts_the_answer_from_a_chat_reply(chat_ckpt):
    from stages.grade.pool import grade_batch

    _, tok = _load(chat_ckpt)
    reply = tok("So 6*7 = 42, and the answer is \\boxed{42}.", add_special_tokens=False)["input_ids"]
    reply.append(tok.convert_tokens_to_ids("<|im_end|>"))
    text = tok.batch_decode([reply], skip_special_tokens=True)[0]
    assert "<|im_end|>" not in text
    [graded] = grade_batch(["q#0"], [text], ["42"], verifier="math")
    assert graded.correct and graded.extracted == "42"
