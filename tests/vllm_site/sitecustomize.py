"""Put on ``PYTHONPATH`` of the ``vllm serve`` the tests start: every process of it (the API server,
the engine core, its worker) asks Linux for the AMX tile state first, as the in-process engine does
(``stages.engines.vllm_options.request_cpu_amx``; without it vLLM's AMX attention kernel can die with
SIGILL on its first call)."""

try:
    import torch

    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
except Exception:  # noqa: BLE001 - never stop an interpreter from starting
    pass
