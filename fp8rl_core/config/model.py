"""The policy, its task, its data and prompt format, and the bootstrap that makes the tiny policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fp8rl_core.config.section import Section


class OutlierConfig(Section):
    """Activation outliers like a pretrained LLM's, seen by the policy's low-precision passes only.

    In ``channels`` hidden channels (the same ones in every decoder block, chosen by ``model.seed``)
    every linear that quantizes (FP8/FP4 training and rollout) the input of a projection an RMSNorm
    feeds quantizes that input times ``2**log2_scale`` and the weight's matching columns divided by it:
    the same product in real arithmetic, while the outlier channels set the quantization scales
    (per-tensor ones most of all). BF16 passes (training, the shadow, a BF16 rollout) do not apply it
    and keep the plain policy's bits; the trained parameters stay the plain ones (the scale is a
    fixed buffer, not in checkpoints). Applied to the converted policy (``stages.context.open_run``,
    ``fp8rl_core.precision.outliers``); not part of the bootstrap."""

    channels: int = Field(0, ge=0, le=4096, description="Hidden channels made outliers (0: none).")
    log2_scale: int = Field(
        14,
        ge=1,
        le=24,
        description="The outlier channels' scale, as a power of two. FP8 E4M3's exponent absorbs outliers up to "
        "about 2**12 above the typical activation (docs/calibration.md); the error grows past 2**14.",
    )


class ModelConfig(Section):
    """The policy. ``path`` set: a Hugging Face checkpoint; unset: the tiny model
    built and bootstrapped by the project (sizes below)."""

    path: str | None = Field(None, description="HF model id or local dir; None = the embedded tiny Qwen3 model.")
    hidden_size: int = Field(
        128, ge=16, le=16384, multiple_of=16, description="Tiny model hidden size (multiple of 16 for FP8 kernels)."
    )
    num_layers: int = Field(2, ge=1, le=12, description="Tiny model decoder layers.")
    num_heads: int = Field(4, ge=1, le=256, description="Tiny model attention heads.")
    num_kv_heads: int = Field(4, ge=1, le=256, description="Tiny model key/value heads (GQA when < num_heads).")
    intermediate_size: int = Field(384, ge=16, le=65536, multiple_of=16, description="Tiny model MLP width.")
    max_position_embeddings: int = Field(256, ge=32, le=1 << 20, description="Tiny model context length (tokens).")
    tie_word_embeddings: bool = Field(True, description="Tie lm_head to the input embeddings (tiny model).")
    seed: int = Field(0, description="Seed of the tiny model's initial weights.")
    outliers: OutlierConfig = Field(
        default_factory=OutlierConfig,
        description="Synthetic activation outliers seen by the low-precision passes (BF16 keeps its bits; a lever "
        "for FP8 noise).",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        if self.outliers.channels > self.hidden_size:
            raise ValueError(f"model.outliers.channels={self.outliers.channels} exceeds model.hidden_size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.num_kv_heads}"
            )
        return self


class DatasetRef(Section):
    """A problem set read through ``datasets`` (``stages.data.datasets_io``): a Hugging Face
    dataset name, a local folder laid out as a Hub dataset repo, a ``save_to_disk``
    folder, or a JSONL / JSON / Parquet file."""

    source: str = Field(
        description="HF dataset name (org/name), a local dataset folder, a save_to_disk folder, or "
        "a .jsonl/.json/.parquet file; relative paths resolve against task.data_dir."
    )
    config: str | None = Field(None, description="Dataset config (subset) name, e.g. 'main' for openai/gsm8k.")
    split: str = Field("train", description="Split to read.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    question_field: str = Field("problem", description="Field holding the question text.")
    answer_field: str = Field("answer", description="Field holding the gold answer (see answer_format).")
    id_field: str | None = Field(None, description="Field holding a stable id; None = the row index.")
    answer_format: Literal["plain", "gsm8k", "boxed"] = Field(
        "plain",
        description="How the gold answer reads: "
        "plain value; GSM8K's '#### n' "
        "last line; the last \\boxed{} "
        "of a solution.",
    )
    limit: int | None = Field(None, ge=1, description="Use the first N rows (None = all).")


class TaskConfig(Section):
    """The training prompts and their verifier."""

    kind: str = Field(
        "synthetic",
        description="Prompt source, a name in fp8rl_core.tasks.kinds.TASK_KINDS: the procedural arithmetic "
        "task (synthetic), DeepScaleR-format JSON, GSM8K train, "
        "DAPO-Math-17K (BytedTsinghua-SIA/DAPO-Math-17k, verl format), the long-chain stress task "
        "(fp8rl_core.tasks.stress), or a code task (code_tiny: the embedded expression task; leetcode: the shipped "
        "rLLM train set; taco/apps/eurus_code: by HF name), graded in the sandbox (see code), or task.dataset "
        "(any dataset by name or path).",
    )
    difficulty: int = Field(1, ge=0, le=3, description="Synthetic task difficulty level.")
    train_size: int = Field(
        200_000, ge=1, description="Synthetic train split size (problems; drawn lazily from the seed)."
    )
    path: str | None = Field(
        None,
        description="Train file or HF dataset name for non-synthetic kinds; relative paths resolve against data_dir.",
    )
    data_dir: str | None = Field(None, description="Benchmark/data folder; default: $FP8RL_DATA_DIR.")
    seed: int = Field(
        1234, description="Seed of the synthetic task generator (train/test splits are disjoint by construction)."
    )
    hub: bool = Field(
        False,
        description="Read path (or the kind's default dataset) from the Hugging Face Hub (a "
        "machine with network access).",
    )
    dataset: DatasetRef | None = Field(
        None, description="kind=dataset: the training set (HF name or local path, split, config, field mapping)."
    )

    @model_validator(mode="after")
    def _dataset_given(self) -> "TaskConfig":
        if self.kind == "dataset" and self.dataset is None:
            raise ValueError("task.kind=dataset needs task.dataset (source, split, fields)")
        return self


class BootstrapConfig(Section):
    """Supervised warm start of the tiny model (ignored when model.path is set)."""

    steps: int = Field(
        1200,
        ge=0,
        description="SFT step cap. Budget in steps, not seconds (the learning jump "
        "moves by ~200 steps between seeds); typical runs stop at 540-670 "
        "via switch_loss.",
    )
    batch_size: int = Field(128, ge=1, description="SFT batch size (sequences).")
    lr: float = Field(
        1e-3,
        gt=0,
        description="AdamW peak learning rate (cosine decay); 3e-3 left one seed on its plateau past step 1100.",
    )
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps.")
    seed: int = Field(0, description="Seed of the noisy teacher's demonstrations (weight init is model.seed).")
    carry_drop: float = Field(
        0.45,
        ge=0,
        lt=0.5,
        description="Noisy teacher: probability of forgetting each carry (< 0.5 keeps the right answer the mode).",
    )
    noisy_steps: int = Field(
        200, ge=0, description="Noisy teacher: SFT steps on noisy demonstrations after the clean phase."
    )
    switch_loss: float = Field(
        0.02, gt=0, description="Switch from the exact to the noisy teacher once the running SFT loss is below this."
    )
    threads: int = Field(2, ge=1, description="torch threads during bootstrap.")


class PromptConfig(Section):
    """How a problem becomes the model's input (``stages.data.prompt_format``)."""

    format: Literal["auto", "chat", "plain"] = Field(
        "auto",
        description="chat: the tokenizer's chat template "
        "(instruct checkpoints); plain: the text "
        "as is (base models, as the paper's "
        "Qwen3-8B-Base runs); auto: chat only for "
        "an instruct checkpoint that has a "
        "template.",
    )
    system_prompt: str | None = Field(None, description="System message (chat format only); None = none.")
    instruction: str | None = Field(
        None,
        description="Answer-format instruction appended to each math problem; "
        "None = the built-in step-by-step/\\boxed{} one.",
    )
    enable_thinking: bool | None = Field(
        None, description="Passed to chat templates that take it (Qwen3); None = the template's default."
    )


class CodeConfig(Section):
    """Code RL: sandbox limits and prompt templates (stages.grade.sandbox, stages.grade.code). Defaults: our choice."""

    per_test_s: float = Field(4.0, gt=0, description="Wall-clock (and CPU, rounded up) limit of one test case.")
    per_sample_s: float = Field(
        20.0, gt=0, description="Wall-clock limit of all test cases of one response; cases left fail."
    )
    batch_wall_s: float = Field(
        120.0,
        gt=0,
        description="Grading of one batch never holds the step longer than this; responses not started score 0.",
    )
    max_sandboxes: int = Field(4, ge=1, description="Sandboxes run at once.")
    memory_mb: int = Field(1024, ge=64, description="Address-space limit of a program (RLIMIT_AS).")
    output_bytes: int = Field(1 << 20, ge=1024, description="stdout cap; a program writing more is killed and fails.")
    nproc: int = Field(32, ge=2, description="Process/thread cap of a program (RLIMIT_NPROC under its throw-away uid).")
    allow_unisolated: bool = Field(
        False, description="Run programs even when no namespace isolation is available (rlimits only). Unsafe."
    )
    stdio_template: str = Field(
        "{problem}\n\nWrite a Python 3 program that reads the input from stdin and prints the answer to stdout. "
        "Put the complete program in one ```python code block.",
        description="Prompt of stdin/stdout problems ({problem} = the statement).",
    )
    functional_template: str = Field(
        "{problem}\n\nComplete the class Solution in Python 3 and put it in one ```python code block.",
        description="Prompt of LeetCode-style (function-call) problems.",
    )
