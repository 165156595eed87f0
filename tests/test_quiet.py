"""Nothing phones home when the project's own commands run: the project configures DVC analytics and
Prefect telemetry off itself, without relying on CI=true or the caller's environment."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

TRACKING_VARIABLES = ("CI", "DO_NOT_TRACK", "DVC_NO_ANALYTICS", "DVC_TEST", "PREFECT_SERVER_ANALYTICS_ENABLED")


def run_clean(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in TRACKING_VARIABLES and not k.startswith("GITHUB")}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_dvc_analytics_off_by_repository_config():
    assert run_clean("from dvc.analytics import is_enabled; print(is_enabled())") == "False"


def test_prefect_server_analytics_off_by_prefect_toml():
    code = "from prefect.settings import get_current_settings; print(get_current_settings().server.analytics_enabled)"
    assert run_clean(code) == "False"


def test_prefect_client_telemetry_off_once_flows_import():
    code = (
        "import flows.build\n"
        "from prefect._internal.analytics.enabled import is_telemetry_enabled\n"
        "print(is_telemetry_enabled())"
    )
    assert run_clean(code) == "False"
