"""Prefect flows over the same DVC-driven stages: schedules, retries, logs and artifacts."""

import os

# Keep Prefect's client telemetry on this machine even where prefect.toml is not in the working
# directory (the server side is turned off in prefect.toml). CI=true alone does not stop it.
os.environ.setdefault("DO_NOT_TRACK", "1")
