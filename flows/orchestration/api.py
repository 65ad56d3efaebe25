"""Prefect, imported only after its environment is set (:mod:`flows.orchestration.env`).

Prefect reads its settings when it is first imported, so the environment must
be in place before. Modules of the flow layer import Prefect's names from here,
in an ordinary import block, and the order is right whatever imports first.
"""

from __future__ import annotations

from flows.orchestration.env import configure_prefect_env, quiet_third_party

configure_prefect_env()
quiet_third_party()

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

__all__ = ["NO_CACHE", "create_markdown_artifact", "create_table_artifact", "flow", "get_run_logger", "task"]
