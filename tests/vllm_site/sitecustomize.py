"""Put on ``PYTHONPATH`` of the ``vllm serve`` (and the engine processes) the tests start.

* Every process of it (the API server, the engine core, its worker) asks Linux for the AMX
  tile state first, as the in-process engine does
  (``stages.engines.vllm_options.request_cpu_amx``; without it vLLM's AMX attention kernel can
  die with SIGILL on its first call).
* With ``FP8RL_TEST_NCCL_STANDIN=1``, vLLM's NCCL weight-transfer data plane runs over gloo
  (``fp8rl_nccl_standin``, beside this file): the real ``NCCLWeightTransferEngine`` of the
  server's worker then receives what the trainer's real ``NCCLTrainerWeightTransferEngine``
  sends.
"""

import os

try:
    import torch

    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
except Exception:  # noqa: BLE001 - never stop an interpreter from starting
    pass

if os.environ.get("FP8RL_TEST_NCCL_STANDIN") == "1":
    import fp8rl_nccl_standin

    fp8rl_nccl_standin.install()
