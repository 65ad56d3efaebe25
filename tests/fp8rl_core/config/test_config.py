"""Config loading: presets validate, typos and wrong types name the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.campaign.configuration import CONFIG_DIR, ConfigError, config_from_dict, dump_config, load_config
from fp8rl_core.config.campaign import CampaignConfig

PRESETS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_validates_and_round_trips(name):
    cfg = load_config(name)
    again = config_from_dict(__import__("yaml").safe_load(dump_config(cfg)))
    assert again == cfg


def test_paper_presets_carry_the_paper_values():
    c = load_config("qwen3-8b-grpo-deepscaler")
    assert (c.rollout.prompts_per_step, c.algorithm.lr, c.algorithm.tis_cap) == (256, 1e-6, 2.0)
    assert (c.calibration.interval, c.evaluation.interval, c.steps) == (20, 25, 500)
    d = load_config("qwen3-14b-dapo")
    assert d.algorithm.dynamic_sampling and d.algorithm.overlong_shaping and d.steps == 200
    assert (d.algorithm.eps_low, d.algorithm.eps_high) == (0.2, 0.28)
    assert d.evaluation.benchmarks[0].name == "aime24" and d.evaluation.benchmarks[0].k == 32


def test_unknown_key_names_key_and_file(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("calibration:\n  intervl: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "calibration.intervl: unknown key" in str(e.value) and str(p) in str(e.value)


def test_wrong_type_names_key(tmp_path: Path):
    p = tmp_path / "bad.yaml"
    p.write_text("rollout:\n  samples_per_prompt: many\n")
    with pytest.raises(ConfigError, match=r"rollout\.samples_per_prompt"):
        load_config(p)


def test_set_overrides_apply_and_are_typed():
    cfg = load_config("tiny-cpu", ["calibration.interval=7", "algorithm.lr=3e-4", "precision.train=fp8_rowwise"])
    assert cfg.calibration.interval == 7 and cfg.algorithm.lr == 3e-4 and cfg.precision.train == "fp8_rowwise"


def test_set_override_typo_is_an_error():
    with pytest.raises(ConfigError, match=r"calibration\.intervl: unknown key"):
        load_config("tiny-cpu", ["calibration.intervl=7"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config("tiny-cpu", ["calibration.interval"])


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="micro_batch_size"):
        config_from_dict({"algorithm": {"ppo_mini_batch_size": 100, "micro_batch_size": 30}})
    with pytest.raises(ConfigError, match="lower_min"):
        config_from_dict({"calibration": {"lower_min": 0.9, "lower_max": 0.7}})
    with pytest.raises(ConfigError, match="unknown key"):
        config_from_dict({"precison": {"train": "bf16"}})


def test_unknown_precision_lists_choices():
    with pytest.raises(ConfigError, match="fp8_tensorwise"):
        config_from_dict({"precision": {"train": "fp8_columnwise"}})


def test_initial_bounds_default_to_the_epsilons():
    cfg = CampaignConfig()
    from fp8rl_core.calibration.clip_modes import initial_bounds

    a = cfg.algorithm
    assert initial_bounds(eps_low=a.eps_low, eps_high=a.eps_high, config=cfg.calibration) == pytest.approx((0.8, 1.28))


def test_missing_preset_is_a_clear_error():
    with pytest.raises(ConfigError, match="config not found"):
        load_config("no-such-preset")


def test_presets_match_the_paper_32b_and_dapo():
    g = load_config("qwen2.5-32b-grpo")
    assert (g.steps, g.evaluation.interval) == (500, 25)  # the paper; was 300 steps
    assert g.checkpoint.keep_best_metric == "average/avg@k"  # best benchmark average keeps the checkpoint
    assert g.checkpoint.interval <= g.evaluation.interval and g.evaluation.interval % g.checkpoint.interval == 0
    d = load_config("qwen3-14b-dapo")
    assert (d.task.kind, d.task.path, d.task.hub) == ("dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k", True)


def test_best_average_metric_and_the_dapo_record_parser():
    from stages.data.benchmarks import TRAIN_SOURCES
    from stages.evaluate import AVERAGE_KEY, benchmark_average

    rows = [
        {"benchmark": "aime24", "metric": "avg@k", "k": 16, "value": 0.3},
        {"benchmark": "aime24", "metric": "pass@k", "k": 16, "value": 0.6},
        {"benchmark": "math500", "metric": "avg@k", "k": 1, "value": 0.7},
    ]
    assert benchmark_average(rows) == {AVERAGE_KEY: pytest.approx(0.5)}
    assert TRAIN_SOURCES.get("dapo_math").hf[0] == "BytedTsinghua-SIA/DAPO-Math-17k"
    rec = {
        "prompt": [
            {
                "role": "user",
                "content": "Solve the following math problem step by step. The last line of "
                "your "
                "response should be of the form Answer: $Answer (without quotes) where $Answer is the answer to "
                "the problem.\n\nWhat is 2+3?\n\nRemember to put your answer on its own line after "
                '"Answer:".',
            }
        ],
        "reward_model": {"ground_truth": "5", "style": "rule-lean"},
        "extra_info": {"index": "abc"},
    }
    assert TRAIN_SOURCES.get("dapo_math").parser(rec, 0) == ("abc", "What is 2+3?", "5")


@pytest.mark.parametrize(
    "key, value, kind",
    [
        ("precision.train", "fp8_columnwise", "training precision mode"),
        ("precision.rollout", "fp8_per_row", "rollout precision mode"),
        ("calibration.mode", "calibrate", "clip mode"),
        ("algorithm.loss", "ppoo", "policy loss"),
        ("algorithm.advantage", "grp", "advantage estimator"),
        ("algorithm.loss_agg", "token_mean", "loss aggregation mode"),
    ],
)
def test_a_name_no_registry_holds_is_an_error_naming_the_key_and_the_valid_names(key, value, kind):
    """The registries are the one list of names: no Literal repeats them, the check at load reads them."""
    from fp8rl_core.registered import NAMED_BY_REGISTRY

    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", [f"{key}={value}"])
    msg = str(err.value)
    assert f"{key}: unknown {kind} {value!r}; valid: " in msg
    valid = NAMED_BY_REGISTRY[key][1].names()
    assert all(name in msg for name in valid) and len(valid) >= 2


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["precision.backend=torchao", "precision.train=bf16"], "applies to FP8 training"),
        (["precision.backend=emulated", "precision.train=nvfp4"], "applies to FP8 training"),
        (["precision.backend=torchao", "precision.train=fp8_blockwise", "precision.emulate=true"], "no emulation"),
        (["precision.backend=triton"], "'auto', 'emulated' or 'torchao'"),
    ],
)
def test_the_fp8_backend_setting_is_checked_when_the_config_loads(sets, says):
    with pytest.raises(ConfigError, match=says):
        load_config("tiny-cpu", sets)
    assert load_config("tiny-cpu", ["precision.backend=torchao"]).precision.backend == "torchao"


def test_the_rehearsal_preset_keeps_the_8b_presets_sections_and_switches():
    """The CPU rehearsal sets every section the 8B GPU preset sets, and the same switches."""
    import yaml

    gpu = yaml.safe_load((CONFIG_DIR / "qwen3-8b-grpo-deepscaler.yaml").read_text())
    cpu = yaml.safe_load((CONFIG_DIR / "rehearsal-cpu.yaml").read_text())
    assert set(gpu) - {"storage"} <= set(cpu)
    for section in ("rollout", "algorithm", "calibration", "checkpoint", "timeouts"):
        assert set(gpu[section]) - {"gpu_memory_utilization"} <= set(cpu[section]) | {"top_p"}, section
    rehearsal = load_config("rehearsal-cpu")
    assert rehearsal.rollout.engine == "vllm" and rehearsal.precision.train == load_config(
        "qwen3-8b-grpo-deepscaler").precision.train
    assert rehearsal.algorithm.activation_checkpointing and rehearsal.checkpoint.keep_best_metric == "average/avg@k"
