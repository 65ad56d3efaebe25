"""``fp8rl plan``: the command. It measures (:mod:`flows.plan.measured`) and prints the
arithmetic of :mod:`flows.plan.memory` beside it, or the arithmetic alone (``--analytic``); then
the generation work per rollout engine (:mod:`flows.plan.work`). With ``--rollout-gpus R``
it plans a split placement instead (:mod:`flows.plan.split`)."""

from __future__ import annotations

from flows.plan.memory import format_plan, memory_plan


def register(app) -> None:
    import typer

    @app.command("plan")
    def plan(
        config: str = typer.Argument(..., help="Preset name in configs/ or a YAML file."),
        gpus: int = typer.Option(8, "--gpus", min=1, help="GPUs the policy is sharded over (FSDP2)."),
        gpu_memory: float = typer.Option(80.0, "--gpu-memory", min=1.0, help="Memory per GPU, GiB."),
        set_: list[str] = typer.Option([], "--set", help="Override a config value (repeatable)."),
        prompt_tokens: int = typer.Option(1024, "--prompt-tokens", min=1, help="Prompt length cap, tokens."),
        analytic: bool = typer.Option(False, "--analytic", help="Arithmetic only (seconds): skip the measurement."),
        rollout_gpus: int = typer.Option(
            0, "--rollout-gpus", min=0,
            help="A split placement: the rollout engine on this many other GPUs (memory per GPU, expected step time).",
        ),
        gpu_kind: str = typer.Option("h100", "--gpu-kind", help="Peak rates for the expected step time: h100 or h200."),
        response_fill: float = typer.Option(
            1.0, "--response-fill",
            help="Split placement: mean response length as a share of max_new_tokens (1: all at the budget).",
        ),
    ) -> None:
        """Per-GPU memory plan of a campaign under FSDP2, measured on fake tensors; says whether it fits."""
        from flows.campaign.configuration import ConfigError, load_config
        from flows.commands.common import fail
        from flows.plan.work import format_work_balance

        try:
            cfg = load_config(config, set_)
            if rollout_gpus:
                from flows.plan.split import GPU_RATES, format_split, split_plan

                if gpu_kind not in GPU_RATES:
                    raise ValueError(f"--gpu-kind must be one of {', '.join(GPU_RATES)}, got {gpu_kind!r}")
                rates = GPU_RATES[gpu_kind]
                split = split_plan(cfg, gpus=gpus, rollout_gpus=rollout_gpus, gpu_memory_gib=gpu_memory,
                                   prompt_tokens=prompt_tokens, rates=rates, response_fill=response_fill)
                typer.echo(format_split(cfg, split, gpus=gpus, rollout_gpus=rollout_gpus, gpu_memory_gib=gpu_memory,
                                        rates=rates, response_fill=response_fill))
                return
            p = memory_plan(cfg, gpus=gpus, gpu_memory_gib=gpu_memory, prompt_tokens=prompt_tokens)
            work = format_work_balance(cfg, gpus=gpus)
        except (ConfigError, ValueError) as err:
            raise fail(str(err))
        if analytic:
            typer.echo(format_plan(cfg, p, gpus=gpus, gpu_memory_gib=gpu_memory))
            typer.echo(work)
            return
        from flows.plan.measured import format_measured, measured_plan, plan_precision_line

        typer.echo(plan_precision_line(cfg))
        m = measured_plan(cfg, gpus=gpus, gpu_memory_gib=gpu_memory, prompt_tokens=prompt_tokens)
        typer.echo(format_measured(cfg, m, gpus=gpus, gpu_memory_gib=gpu_memory, prompt_tokens=prompt_tokens))
        typer.echo(work)
