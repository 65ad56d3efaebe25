"""Score centering: each token's score centered by its mean under the rollout engine's distribution.

The reference is the definition itself, computed the slow way in float64 over the whole
vocabulary: for a loss ``sum_t c_t log p(y_t)`` the centered gradient on the logits of
position ``t`` is ``c_t (onehot(y_t) - mu_t)`` instead of ``c_t (onehot(y_t) - p_t)``, with
``mu_t`` the engine's probabilities over its top-K tokens renormalized (zero elsewhere).
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from fp8rl_core.objective.logprobs import center_scores, token_logprobs_and_entropy
from stages.train import build_batch


def _case(seed: int, b=3, t=5, v=11, k=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (b, t), generator=g)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(b * t)]).reshape(b, t, k)
    mu = torch.softmax(torch.randn(b, t, k, generator=g, dtype=torch.float64), -1)
    mu[0, 0] = 0  # a position without engine top-k (prompt, padding): no term there
    coef = torch.randn(b, t, generator=g, dtype=torch.float64)
    return logits, labels, ids, mu, coef


@pytest.mark.parametrize("seed", range(4))
def test_the_centered_gradient_is_the_definition_and_the_values_do_not_move(seed):
    logits, labels, ids, mu, coef = _case(seed)
    z = logits.clone().requires_grad_(True)
    lp, _ = token_logprobs_and_entropy(z, labels)
    centered = center_scores(z, labels, lp.double(), ids, mu)
    assert torch.equal(centered.detach(), lp.double().detach())  # ratios, clipping, metrics: unchanged
    (coef * centered).sum().backward()

    p = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(labels, logits.shape[-1]).double()
    mu_full = torch.zeros_like(p).scatter_(-1, ids, mu)
    has = (mu.sum(-1, keepdim=True) > 0).double()
    want = coef[..., None] * (onehot - (has * mu_full + (1 - has) * p))
    torch.testing.assert_close(z.grad, want, rtol=1e-5, atol=1e-6)  # float32 log-softmax inside


def test_on_policy_with_the_whole_vocabulary_the_centered_score_has_mean_zero():
    """With mu = p over every token, E_{y~p}[onehot(y) - mu] = 0: the centered score has no mean,
    where the plain one's mean is also 0 on-policy; off-policy only the centered one keeps mean 0."""
    torch.manual_seed(0)
    v = 7
    z = torch.randn(1, 1, v, dtype=torch.float64)
    p = torch.softmax(z, -1)
    mu_engine = torch.softmax(z + 0.5 * torch.randn_like(z), -1)  # an engine that differs from the trainer
    ids = torch.arange(v).reshape(1, 1, v)
    mean_plain = torch.zeros(v, dtype=torch.float64)
    mean_centered = torch.zeros(v, dtype=torch.float64)
    for y in range(v):  # the expectation over the engine's samples, exactly
        zz = z.clone().requires_grad_(True)
        lp, _ = token_logprobs_and_entropy(zz, torch.tensor([[y]]))
        g_plain = torch.autograd.grad(lp.double().sum(), zz, retain_graph=True)[0]
        g_cent = torch.autograd.grad(center_scores(zz, torch.tensor([[y]]), lp.double(), ids, mu_engine).sum(), zz)[0]
        mean_plain += mu_engine[0, 0, y] * g_plain[0, 0]
        mean_centered += mu_engine[0, 0, y] * g_cent[0, 0]
    assert float(mean_plain.abs().max()) > 1e-2  # the mismatch biases the plain score
    assert float(mean_centered.abs().max()) < 1e-6
    torch.testing.assert_close(mean_plain, (mu_engine - p)[0, 0], rtol=1e-5, atol=1e-6)


def _rows(with_top: bool) -> tuple[pa.Table, pa.Table]:
    cols = {
        "sample_id": pa.array([0, 1], pa.int32()),
        "prompt_token_ids": pa.array([[1, 2, 3], [1, 2]], pa.list_(pa.int32())),
        "response_token_ids": pa.array([[4, 5], [6, 7, 8]], pa.list_(pa.int32())),
        "rollout_logp": pa.array([[-0.5, -0.2], [-1.0, -0.3, -0.1]], pa.list_(pa.float32())),
    }
    if with_top:
        cols["top_token_ids"] = pa.array([[[4, 9], [5, 4]], [[6, 1], [7, 2], [8, 3]]], pa.list_(pa.list_(pa.int32())))
        cols["top_logprobs"] = pa.array(
            [[[-0.5, -1.5], [-0.2, float("-inf")]], [[-1.0, -1.0], [-0.3, -2.0], [-0.1, -3.0]]],
            pa.list_(pa.list_(pa.float32())),
        )
    scores = pa.table({"sample_id": pa.array([0, 1], pa.int32()), "kept": [True, True], "advantage": [1.0, -1.0]})
    return pa.table(cols), scores


def test_the_batch_places_each_tokens_top_k_at_its_response_column_renormalized():
    rows, scores = _rows(with_top=True)
    batch = build_batch(rows, scores, pad_id=0, top_k=2)
    ids, mu = batch.centering
    assert ids.shape == mu.shape == (2, 5, 2)
    assert ids[0, 3].tolist() == [4, 9] and ids[0, 4].tolist() == [5, 4] and ids[1, 2].tolist() == [6, 1]
    torch.testing.assert_close(mu[0, 3], torch.softmax(torch.tensor([-0.5, -1.5]), -1))
    assert mu[0, 4].tolist() == [1.0, 0.0]  # outside the nucleus (-inf): no mass
    assert mu[1, 2].tolist() == [0.5, 0.5]
    # prompt and padding columns carry nothing; every response column sums to 1
    assert float(mu[0, :3].abs().sum()) == 0 and float(mu[1, 5:].abs().sum()) == 0
    assert torch.allclose(mu.sum(-1), batch.response_mask)
    assert build_batch(rows, scores, pad_id=0).centering is None


def test_centering_on_rollouts_without_top_k_is_one_line_naming_the_setting():
    rows, scores = _rows(with_top=False)
    with pytest.raises(RuntimeError, match=r"step 7: its rollouts carry no top-2 log-probs .*score_centering_k=0"):
        build_batch(rows, scores, pad_id=0, step=7, top_k=2)


def test_the_transformers_engine_returns_top_k_without_changing_its_samples():
    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.config.pipeline import RolloutConfig
    from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
    from stages.engines import SamplingRequest, make_engine

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                         intermediate_size=64), len(tok.get_vocab()))
    engine = make_engine("transformers", model=model, tokenizer=tok, precision=PrecisionConfig(rollout="bf16"),
                         config=RolloutConfig())
    args = dict(n=3, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=3)
    plain = engine.generate([[1, 5, 6], [1, 7]], SamplingRequest(**args))
    top = engine.generate([[1, 5, 6], [1, 7]], SamplingRequest(top_k=5, **args))
    assert [s.response_ids for s in plain.samples] == [s.response_ids for s in top.samples]
    assert [s.response_logprobs for s in plain.samples] == [s.response_logprobs for s in top.samples]
    assert all(s.top_ids is None for s in plain.samples)
    for s in top.samples:
        assert len(s.top_ids) == len(s.response_ids)
        for y, lp, ids, lps in zip(s.response_ids, s.response_logprobs, s.top_ids, s.top_logprobs):
            assert len(ids) == 5 and lps == sorted(lps, reverse=True)
            assert lp <= lps[0] and (y not in ids or lps[ids.index(y)] == lp)


def test_the_setting_is_checked_when_the_config_loads():
    from flows.campaign.configuration import ConfigError, load_config

    assert load_config("tiny-cpu", ["algorithm.score_centering_k=4"]).algorithm.score_centering_k == 4
    with pytest.raises(ConfigError, match="score_centering_k"):
        load_config("tiny-cpu", ["algorithm.score_centering_k=21"])
    with pytest.raises(ConfigError, match="which rollout.engine vllm_http does not request"):
        load_config("tiny-cpu", ["algorithm.score_centering_k=4", "rollout.engine=vllm_http",
                                 "rollout.server_url=http://127.0.0.1:9"])


def _grads_after_one_micro_batch_pass(batch):
    from stages.trainer.batch import split_rows
    from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE
    from stages.trainer.minibatch import micro_batch_pass
    from stages.trainer.old_logp import old_logprobs
    from stages.trainer.optimizer import make_optimizer
    from stages.trainer.types import TrainStep
    from tests.scaleout_common import small_cfg, small_model

    cfg, model = small_cfg("bf16"), small_model("bf16")
    rows = split_rows(batch, cfg, seed=3, collective=SINGLE_PROCESS_COLLECTIVE, device=torch.device("cpu"),
                      shadow_rows=None)
    opt, sched = make_optimizer(model, cfg)
    step = TrainStep(model, opt, sched, cfg, SINGLE_PROCESS_COLLECTIVE, rows, (0.8, 1.28), False, None, None)
    done = micro_batch_pass(step, old_logprobs(step), 0, (0.8, 1.28))
    return done.loss, torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]), model


def _own_distribution(model, batch):
    """mu = the trainer's own distribution over the whole vocabulary at each response token."""
    from fp8rl_core.objective.logprobs import position_ids_from_mask
    from fp8rl_core.precision.autocast import autocast_context

    with torch.no_grad(), autocast_context("bf16", torch.device("cpu")):
        mask = batch.attention_mask
        logits = model(input_ids=batch.input_ids, attention_mask=mask,
                       position_ids=position_ids_from_mask(mask)).logits.float()
    n, t, v = logits.shape
    mu = torch.zeros(n, t, v)
    mu[:, 1:] = torch.softmax(logits[:, :-1], -1) * batch.response_mask[:, 1:, None]
    return torch.arange(v).expand(n, t, v).clone(), mu


def test_a_micro_batch_pass_with_centering_keeps_its_loss_and_centers_its_gradient():
    """The trainer's pass: the same loss bits; another gradient under another distribution; and under
    the trainer's own distribution (mu = p, nothing to center) the plain gradient back."""
    import dataclasses

    from tests.scaleout_common import small_batch

    batch = small_batch()
    loss, plain, model = _grads_after_one_micro_batch_pass(batch)
    g = torch.Generator().manual_seed(1)
    v = model.config.vocab_size
    n, t = batch.input_ids.shape
    ids = torch.randint(0, v, (n, t, 4), generator=g)
    mu = torch.softmax(torch.randn(n, t, 4, generator=g), -1) * batch.response_mask[..., None]
    loss_c, centered, _ = _grads_after_one_micro_batch_pass(dataclasses.replace(batch, center_ids=ids, center_mu=mu))
    assert loss_c == loss
    own = _own_distribution(model, batch)
    _, same, _ = _grads_after_one_micro_batch_pass(dataclasses.replace(batch, center_ids=own[0], center_mu=own[1]))
    # the logits' gradient is summed in bf16 (the logits' dtype under autocast): a few bf16 roundings
    # (2^-8 each) of the gradient's norm separate "the same" from the plain one
    off = float((same - plain).norm() / plain.norm())
    moved = float((centered - plain).norm() / plain.norm())
    assert off < 4 * 2.0**-8, off
    assert moved > 10 * off, (moved, off)


@pytest.mark.timeout(600)
def test_the_rollout_stage_stores_k_ids_and_log_probs_per_response_token(tmp_path):
    from conftest import micro_config, open_micro_run

    from stages.rollout import run_rollout
    from stages.runtime.io import read_step

    cfg = micro_config("algorithm.score_centering_k=3")
    env, state = open_micro_run(tmp_path, cfg)
    try:
        run_rollout(env, state, 1)
        rows = read_step(env, "rollouts", 1).to_pylist()
    finally:
        env.close()
    assert rows and all(len(r["top_token_ids"]) == len(r["top_logprobs"]) == r["response_length"] for r in rows)
    for r in rows:
        for y, lp, ids, lps in zip(r["response_token_ids"], r["rollout_logp"], r["top_token_ids"], r["top_logprobs"]):
            assert len(ids) == 3 and lp <= lps[0] + 1e-6 and (y not in ids or abs(lps[ids.index(y)] - lp) < 1e-6)
