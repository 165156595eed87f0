"""The scheduled rebuild: upstream revisions followed through the Hub API (a local stand-in server),
and the cron deployment served against a real Prefect server and triggered with run_deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tests.conftest import set_param, tiny_params, wait_for, write_params

OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture
def hub_api(monkeypatch):
    """A local server answering the Hub's model-info call the way huggingface.co does."""
    from huggingface_hub import constants
    from huggingface_hub.utils import reset_sessions

    requests = []

    class Hub(BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            body = json.dumps({"id": "org/tiny", "sha": NEW}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    reset_sessions()  # huggingface_hub caches an HTTP session built for offline mode
    yield requests
    server.shutdown()
    reset_sessions()


def test_follow_upstream_bumps_followed_revision_keeping_comments(tmp_path, tiny_hf, hub_api):
    from flows.scheduled import follow_upstream, upstream_revision

    params = tiny_params(tiny_hf)
    pinned = {"path": "data/sources/pinned.txt"}
    params["models"]["followed"] = {
        "source": {"kind": "hub", "repo_id": "org/tiny", "revision": OLD, "follow": "main"} | pinned
    }
    params["models"]["pinned"] = {"source": {"kind": "hub", "repo_id": "org/other", "revision": OLD} | pinned}
    params["builds"] |= {f"{model}-fp32": {"model": model, "variant": "fp32"} for model in ("followed", "pinned")}
    path = write_params(tmp_path, params)
    path.write_text("# keep this comment\n" + path.read_text())

    moved = follow_upstream.fn(tmp_path, revision_of=upstream_revision.fn)
    assert moved == {"followed": {"from": OLD, "to": NEW, "branch": "main"}}
    assert hub_api == ["/api/models/org/tiny/revision/main"]  # the pinned model is not asked about
    text = path.read_text()
    assert text.startswith("# keep this comment\n")
    assert text.count(NEW) == 1 and text.count(OLD) == 1

    assert follow_upstream.fn(tmp_path, revision_of=upstream_revision.fn) == {}  # already current


@pytest.mark.e2e
def test_served_deployment_rebuilds_then_executes_nothing(built_project, prefect_api):
    from prefect.artifacts import Artifact
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    project = built_project
    set_param(project, ["quantize", "int4", "block_size"], 16)  # the nightly run has a variant to rebuild
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    serving = subprocess.Popen(
        [sys.executable, "-m", "flows.scheduled", "serve", "--root", str(project), "--cron", "0 3 * * *"],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
            wait_for(lambda: deployment_schedule(prefect_api) == "0 3 * * *", seconds=120)
            first = run_deployment("ortforge-rebuild/nightly", timeout=600)
            assert first.state.is_completed(), first.state
            summary = Artifact.get("rebuild-summary").data
            assert "quantize@tiny-int4" in summary and "report@tiny" in summary

            second = run_deployment("ortforge-rebuild/nightly", timeout=600)
            assert second.state.is_completed(), second.state
            assert "Stages executed: none" in Artifact.get("rebuild-summary").data
    finally:
        serving.terminate()
        serving.wait(timeout=30)
    # Everything the rebuild cached was pushed: the default remote holds each output's objects.
    assert any((project.parent / "ortforge-dvc-remote").rglob("*")), "nothing was pushed"
    cloud = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--cloud"], cwd=project, capture_output=True, text=True
    )
    assert cloud.returncode == 0 and "in sync" in cloud.stdout, cloud.stdout + cloud.stderr


def deployment_schedule(api: str) -> str | None:
    from prefect import get_client

    async def read():
        async with get_client() as client:
            deployment = await client.read_deployment_by_name("ortforge-rebuild/nightly")
            return deployment.schedules[0].schedule.cron if deployment.schedules else None

    import asyncio

    return asyncio.run(read())
