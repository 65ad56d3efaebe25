"""The tiny policy: character tokenizer (a real HF fast tokenizer) and Qwen3 factory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from fp8rl_core.config.model import ModelConfig
from fp8rl_core.tasks.synthetic import LEVELS, demonstration, make_problem
from fp8rl_core.tasks.tiny_model import (
    CHARSET,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tiny_model,
    build_tokenizer,
    count_parameters,
    load_policy,
)
from tests.conftest import DATA_DIR, needs_data


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_vocab_layout(tok):
    assert len(tok) == VOCAB_SIZE == 128
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left"


def test_one_token_per_character_with_bos(tok):
    ids = tok("Q:743+580=?A:")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("Q:743+580=?A:")


def test_every_charset_character_round_trips(tok):
    for ch in CHARSET:
        ids = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] >= len(SPECIAL_TOKENS), repr(ch)
        assert tok.decode(ids) == ch, repr(ch)
    assert tok.decode(tok(CHARSET)["input_ids"], skip_special_tokens=True) == CHARSET


def test_unknown_character_maps_to_unk(tok):
    ids = tok("a日b", add_special_tokens=False)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("a"), tok.unk_token_id, tok.convert_tokens_to_ids("b")]


def test_task_texts_round_trip(tok):
    import random

    rng = random.Random(0)
    for d in LEVELS:
        for i in range(200):
            p = make_problem(i, "train", d, 0)
            for text in (p.prompt + p.solution, p.prompt + demonstration(p, d, 0.5, rng)):
                ids = tok(text)["input_ids"]
                assert tok.unk_token_id not in ids
                assert tok.decode(ids, skip_special_tokens=True) == text


def test_saved_tokenizer_loads_with_autotokenizer(tmp_path, tok):
    build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Q:743+580=?A:234#432 \\boxed{\\frac{1}{2}}"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    batch = loaded(["ab", "abcd"], padding=True)["input_ids"]
    assert batch[0][:2] == [loaded.pad_token_id] * 2  # left padding


@needs_data
def test_benchmark_texts_round_trip(tok):
    """Every charset character of the shipped benchmarks' questions and answers
    round-trips; the few others (rare symbols) become UNK, never an error."""
    files = [
        "aime24/test.jsonl",
        "aime25/aime25_from_matharena.DERIVED.jsonl",
        "amc23/test.jsonl",
        "math500/test.jsonl",
        "minerva_math/test.jsonl",
        "olympiadbench/test.jsonl",
        "gsm8k/test.jsonl",
    ]
    texts = []
    for rel in files:
        for line in (Path(DATA_DIR) / rel).read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)  # what the policy reads (questions) and what it should write (answers)
            texts.extend(v for k, v in rec.items() if k in ("problem", "question", "answer") and isinstance(v, str))
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    decoded = tok.batch_decode([[i for i in ids if i != tok.unk_token_id] for ids in encoded])
    charset = set(CHARSET)
    n_chars = n_unknown = 0
    for text, ids, back in zip(texts, encoded, decoded):
        assert len(ids) == len(text)
        known = "".join(c for c in text if c in charset)
        assert back == known
        n_chars += len(text)
        n_unknown += len(text) - len(known)
    assert n_unknown / n_chars < 1e-4, (n_unknown, n_chars)


def test_tiny_model_shapes_and_dtype():
    cfg = ModelConfig()
    model = build_tiny_model(cfg)
    assert model.dtype == torch.float32
    assert model.config.vocab_size == VOCAB_SIZE
    assert model.config.num_hidden_layers == cfg.num_layers and model.config.hidden_size == cfg.hidden_size
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            assert mod.in_features % 16 == 0 and mod.out_features % 16 == 0, name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert 300_000 < count_parameters(model) < 600_000


def test_the_tiny_qwen3_defaults_are_the_embedded_policy(tok):
    """``tiny_qwen3_config()`` is the config of the embedded policy at ``ModelConfig()``'s sizes, with the
    tokenizer's vocabulary and special-token ids; an override replaces one value and leaves the rest."""
    from transformers import Qwen3Config

    from fp8rl_core.tasks.tiny_config import TINY_QWEN3, tiny_qwen3_config

    cfg = ModelConfig()
    spelled_out = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        use_cache=True,
    )
    assert tiny_qwen3_config().to_dict() == spelled_out.to_dict()
    built = build_tiny_model(cfg).config
    assert {k: getattr(built, k) for k in TINY_QWEN3} == dict(TINY_QWEN3)
    other = tiny_qwen3_config(vocab_size=32, bos_token_id=None)
    assert (other.vocab_size, other.bos_token_id, other.hidden_size) == (32, None, 128)
    assert tiny_qwen3_config().vocab_size == 128


def test_tiny_model_seeded_and_rng_neutral():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(ModelConfig(seed=7))
    after = torch.rand(3)
    assert torch.equal(before, after)  # building a model does not consume the caller's RNG
    b = build_tiny_model(ModelConfig(seed=7))
    c = build_tiny_model(ModelConfig(seed=8))
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_path_config_is_refused():
    with pytest.raises(ValueError, match="load_policy"):
        build_tiny_model(ModelConfig(path="some/model"))


def test_load_policy_round_trip(tmp_path):
    model = build_tiny_model(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    )
    tok = build_tokenizer(tmp_path)
    model.save_pretrained(tmp_path)
    loaded, loaded_tok = load_policy(tmp_path)
    ids = torch.tensor([tok("Q:12+34=?A:")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.dtype == torch.float32 and loaded_tok.eos_token_id == tok.eos_token_id
