"""The embedded policy: a tiny ``Qwen3ForCausalLM`` and a character-level tokenizer.

No weights can be downloaded on the machines this project targets, so the default
campaign builds its own policy: a Qwen3-architecture decoder (RMSNorm, rotary
attention with per-head q/k norms, SwiGLU MLP) of a few hundred thousand
parameters, whose sizes come from :class:`fp8rl_core.config.model.ModelConfig`. The
decoder linears have dimensions that are multiples of 16 (the config enforces it)
so FP8 kernels and the emulated FP8 path accept them; the tied embedding /
``lm_head`` stays in high precision, so the vocabulary size need not be.

The tokenizer maps one character to one token. It is a real Hugging Face *fast*
tokenizer (a ``tokenizers`` BPE model with an empty merge list, which splits a
word into its characters, and a ``Fuse`` decoder that joins them back without
spaces), saved with ``save_pretrained`` so that ``AutoTokenizer.from_pretrained``
loads it like any other. Its vocabulary, 128 entries:

* 4 special tokens, ids 0-3: ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``;
* the 95 printable ASCII characters, newline and tab — everything the synthetic
  task writes and nearly everything in the shipped benchmark texts;
* 27 non-ASCII characters that occur in those texts (curly quotes, dashes,
  ``×÷−``, currency signs, vulgar fractions, a few accented letters).

Any other character becomes ``<unk>``: evaluation of the tiny policy on a real
benchmark never crashes, it just sees an unknown symbol. Encoding prepends
``<bos>``; callers append ``<eos>`` to supervised targets themselves. Padding is
on the left, as generation from a batch of prompts of unequal length needs.

:func:`load_policy` is the one entry point for both the tiny model and real
checkpoints: both are plain ``from_pretrained`` directories.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

from fp8rl_core.config.model import ModelConfig
from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

ASCII_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"
# Non-ASCII characters seen in the shipped benchmark texts (GSM8K prose mostly),
# chosen so that the vocabulary totals 128 entries.
EXTRA_CHARS = "’‘“”–—−×÷€£¢°²³½¼¾√πéèñüçöô"
CHARSET = ASCII_CHARS + EXTRA_CHARS
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARSET)
assert len(set(CHARSET)) == len(CHARSET) and VOCAB_SIZE == 128, VOCAB_SIZE


def build_tokenizer(save_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The character-level tokenizer (saved to ``save_dir`` when given).

    Returns a ``PreTrainedTokenizerFast`` whose ``encode`` gives
    ``[bos_id] + [one id per character]`` and whose ``decode(...,
    skip_special_tokens=True)`` is the exact inverse for characters in
    :data:`CHARSET`.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    if save_dir is not None:
        tok.save_pretrained(str(save_dir))
    return tok


def build_tiny_model(cfg: ModelConfig, vocab_size: int = VOCAB_SIZE) -> Qwen3ForCausalLM:
    """A freshly initialised fp32 ``Qwen3ForCausalLM`` with the sizes of ``cfg``.

    Initialisation is seeded by ``cfg.seed`` (the global torch RNG is restored
    afterwards, so building a model does not perturb the caller's stream). The
    special-token ids match :func:`build_tokenizer`.
    """
    if cfg.path is not None:
        raise ValueError(f"model.path={cfg.path!r} is set: load it with load_policy(), not build_tiny_model()")
    config = tiny_qwen3_config(  # its special-token ids are the tokenizer's (a test holds them equal)
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(config)
    model.to(torch.float32)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def load_policy(
    path: str | Path, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Load ``(model, tokenizer)`` from a Hugging Face directory or hub id.

    The same call serves a bootstrapped tiny checkpoint and a real model; the
    master weights are fp32 by default (RL keeps fp32 masters, FP8/bf16 are
    compute dtypes). A tokenizer without a pad token gets its EOS as pad.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
