"""Per-token log-probs and entropies (fp8rl_core.objective.logprobs)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3ForCausalLM  # noqa: E402  (after fp8rl_core: quiet torchao)

from fp8rl_core.objective.logprobs import position_ids_from_mask, sequence_logprobs, token_logprobs_and_entropy
from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.precision.conversion import convert_for_training


def naive(logits: torch.Tensor, labels: torch.Tensor):
    """Full-vocab float64 reference: [B, T, V], [B, T] -> logp, entropy [B, T]."""
    logq = torch.log_softmax(logits.double(), dim=-1)
    logp = logq.gather(-1, labels[..., None]).squeeze(-1)
    return logp, -(logq.exp() * logq).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, None])
def test_chunked_matches_naive_log_softmax(dtype, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 50, (3, 5), generator=g)
    before = logits.clone()
    logp, ent = token_logprobs_and_entropy(logits, labels, chunk_size=chunk_size)
    assert torch.equal(logits, before)  # inputs untouched (chunks are upcast copies)
    ref_lp, ref_ent = naive(logits, labels)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (3, 5)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    assert (ent >= 0).all() and (ent <= torch.log(torch.tensor(50.0)) + 1e-5).all()


def test_hand_values():
    logits = torch.tensor([[[0.0, 0.0], [0.0, 100.0]]])  # uniform, then nearly certain
    logp, ent = token_logprobs_and_entropy(logits, torch.tensor([[0, 1]]))
    torch.testing.assert_close(logp, torch.tensor([[-0.6931472, 0.0]]))
    torch.testing.assert_close(ent, torch.tensor([[0.6931472, 0.0]]))


@pytest.mark.parametrize("which", ["both", "logp", "entropy"])
def test_gradients_match_autograd_of_naive(which):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 40, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 40, (2, 6), generator=g)
    w1, w2 = torch.randn(2, 6, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g, dtype=torch.float64)
    a = logits.float().requires_grad_()
    lp, ent = token_logprobs_and_entropy(a, labels, chunk_size=5)
    b = logits.clone().requires_grad_()
    rlp, rent = naive(b, labels)
    loss = {
        "both": lambda x, y: (x * w1).sum() + (y * w2).sum(),
        "logp": lambda x, y: (x * w1).sum(),
        "entropy": lambda x, y: (y * w2).sum(),
    }[which]
    loss(lp.double(), ent.double()).backward()
    loss(rlp, rent).backward()
    torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


def test_no_float32_vocab_copy_is_kept_for_backward():
    logits = torch.randn(4, 64, 1000, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (4, 64))
    logp, _ = token_logprobs_and_entropy(logits, labels, chunk_size=16)
    saved = logp.grad_fn.saved_tensors
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert big and all(t.dtype == torch.bfloat16 for t in big)  # only the logits themselves
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_strided_logits_are_not_copied_whole():
    """train_core passes logits[:, :-1]; blocks slice it, results match the contiguous copy."""
    logits = torch.randn(3, 9, 20, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 20, (3, 8))
    view = logits[:, :-1]
    lp, ent = token_logprobs_and_entropy(view, labels, chunk_size=4)  # time-split blocks
    lp2, ent2 = token_logprobs_and_entropy(view.detach().contiguous(), labels, chunk_size=100)  # whole-sequence blocks
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2)
    assert lp.grad_fn.saved_tensors[0].data_ptr() == logits.data_ptr()  # the view itself is saved
    lp.sum().backward()
    assert logits.grad[:, -1].abs().sum() == 0 and logits.grad[:, :-1].abs().sum() > 0


def test_bad_inputs():
    logits, labels = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        token_logprobs_and_entropy(logits[0], labels)
    with pytest.raises(ValueError, match="labels must be"):
        token_logprobs_and_entropy(logits, labels[:, :2])
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        token_logprobs_and_entropy(logits, labels + 5)
    with pytest.raises(TypeError, match="integer"):
        token_logprobs_and_entropy(logits, labels.float())
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_and_entropy(logits, labels, chunk_size=0)
    model = Qwen3ForCausalLM(_tiny_config())
    with pytest.raises(ValueError, match="attention_mask"):
        sequence_logprobs(model, labels, labels[:, :2])
    with pytest.raises(ValueError, match="micro_batch_size"):
        sequence_logprobs(model, labels, torch.ones_like(labels), micro_batch_size=0)
    with pytest.raises(KeyError, match="valid"):
        sequence_logprobs(model, labels, torch.ones_like(labels), mode="fp4")


# --------------------------------------------------------------------------- model helper


def _tiny_config():
    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

    return tiny_qwen3_config(vocab_size=32, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(_tiny_config()).eval()


def test_position_ids_count_real_tokens():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 2, 2, 2], [0, 0, 0, 1, 2]]


def test_sequence_logprobs_matches_manual_shift_and_handles_padding(model):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 32, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right-padded response
    ids[1, 7:] = 0
    with torch.no_grad():
        logp, ent = sequence_logprobs(model, ids, mask)
        with autocast_context("bf16"):
            logits = model(input_ids=ids, attention_mask=mask).logits  # [3, 10, V]
    ref_lp, ref_ent = naive(logits[:, :-1], ids[:, 1:])
    assert logp.shape == ent.shape == (3, 10) and logp.dtype == torch.float32
    assert (logp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    assert (logp[1, 7:] == 0).all() and (ent[1, 7:] == 0).all()
    valid = mask[:, 1:].bool()
    torch.testing.assert_close(logp[:, 1:][valid].double(), ref_lp[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[:, 1:][valid].double(), ref_ent[valid], rtol=1e-5, atol=1e-5)
    # padding changes nothing for the real tokens: the unpadded sequence alone agrees
    with torch.no_grad():
        alone, _ = sequence_logprobs(model, ids[1:2, :7], mask[1:2, :7])
    # BF16 batch-shape noise at most (a wrong mask moves them by ~0.2)
    torch.testing.assert_close(logp[1:2, :7], alone, rtol=0, atol=5e-3)


def test_left_padded_prompt_uses_real_positions(model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    padded = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10]])
    pmask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, ids, torch.ones_like(ids), mode="bf16")
        got, _ = sequence_logprobs(model, padded, pmask, mode="bf16")
    assert (got[0, :3] == 0).all()  # pads, and the first real token: no real context
    torch.testing.assert_close(got[:, 3:], ref[:, 1:], rtol=0, atol=5e-3)


def test_micro_batches_precision_modes_and_gradients(model):
    ids = torch.randint(1, 32, (5, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full, _ = sequence_logprobs(model, ids, mask)
        split, ent = sequence_logprobs(model, ids, mask, micro_batch_size=2, with_entropy=False)
    assert ent is None
    torch.testing.assert_close(split, full, rtol=0, atol=5e-3)
    fp8 = copy.deepcopy(model)
    convert_for_training(fp8, "fp8_rowwise")
    # 4 x 8 = 32 tokens: the FP8 weight-gradient kernel needs a multiple of 16 (strict shapes)
    lp8, ent8 = sequence_logprobs(fp8, ids[:4], mask[:4], mode="fp8_rowwise")
    assert lp8.requires_grad and not torch.equal(lp8.detach(), full[:4])
    (lp8.sum() + ent8.sum()).backward()
    grads = [p.grad for p in fp8.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)
