"""Can a campaign's training state fit its device at all? Asked before a run or a sweep writes anything."""

from __future__ import annotations

from fp8rl_core.config.campaign import CampaignConfig


def available_bytes(device: str) -> tuple[int, str] | None:
    """Memory the run's device has (a CUDA device's total, or the host's available memory) and its name."""
    if device.startswith("cuda"):  # asked in a child process: this one must not hold a CUDA context
        import torch

        from flows.plan.device_probe import cuda_memory

        if not torch.cuda.is_available():  # the device count, not a context
            return None
        return cuda_memory(int(device.partition(":")[2] or 0))
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, "this machine's available memory"
    except (OSError, StopIteration, ValueError):
        return None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def memory_refusal(cfg: CampaignConfig, nproc_per_node: int) -> str | None:
    """The line a campaign is refused with when its training state alone (fp32 weights and gradients,
    AdamW's two moments: 16 bytes a parameter, sharded over the ranks; :mod:`flows.plan.memory`) exceeds the
    device's memory, or None. Activations are left out, so what is refused cannot run at all."""
    from flows.plan.memory import GiB, arch_of, total_params

    device = "cuda" if cfg.device == "auto" and _has_cuda() else ("cpu" if cfg.device == "auto" else cfg.device)
    have = available_bytes(device)
    try:
        params = total_params(arch_of(cfg))
    except ValueError:  # a model whose architecture is not on file: nothing to compare
        return None
    need = 16 * params / nproc_per_node
    if have is None or need <= have[0]:
        return None
    return (
        f"the model's training state needs {need / GiB:.1f} GiB per rank ({params / 1e9:.2f} B parameters x "
        f"16 bytes; `fp8rl plan` itemizes the rest) but {have[1]} is {have[0] / GiB:.1f} GiB; make the "
        "model smaller or use more ranks, or start anyway with --skip-memory-check"
    )
