"""Screenshots of a campaign in Prefect's UI, for the README (headless Chromium).

Starts ``prefect server start`` on ``$PREFECT_HOME``'s database (the one the
campaign reported to), picks the newest ``fp8rl-campaign`` flow run that has a
failed attempt (a ``failures-`` artifact; else the newest run), and saves PNGs
of its page (Logs tab) and of its latest bounds summary and step metrics
artifacts under ``docs/``:

    PREFECT_HOME=<home of the campaign> python docs/take_screenshots.py [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DOCS = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_UI_API_URL=api, PREFECT_SERVER_LOGGING_LEVEL="WARNING")
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(f"{api}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        os.environ["PREFECT_API_URL"] = api
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName
        from prefect.client.schemas.sorting import FlowRunSort

        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["fp8rl-campaign"])), sort=FlowRunSort.START_TIME_DESC
            )
            arts = [a for a in client.read_artifacts() if a.key]
        failed = {a.flow_run_id for a in arts if a.key.startswith("failures-")}
        run = next((r for r in runs if r.id in failed), runs[0])
        mine = sorted((a for a in arts if a.flow_run_id == run.id), key=lambda a: a.created)
        ui = f"http://127.0.0.1:{port}"
        pages = {"ui-flow-run.png": f"{ui}/runs/flow-run/{run.id}"}
        for prefix, name in (("bounds-summary-", "ui-bounds-summary.png"), ("steps-", "ui-step-metrics.png")):
            latest = [a for a in mine if a.key.startswith(prefix)]
            if latest:
                pages[name] = f"{ui}/artifacts/artifact/{latest[-1].id}"
        for name, url in pages.items():
            subprocess.run(
                [
                    args.chromium,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--hide-scrollbars",
                    f"--user-data-dir={DOCS / '.chromium-profile'}",
                    "--virtual-time-budget=25000",
                    "--window-size=1280,800",
                    f"--screenshot={DOCS / name}",
                    url,
                ],
                capture_output=True,
                timeout=300,
            )
            print(DOCS / name, url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
