"""Prefect flows over the same DVC-driven stages: schedules, retries, logs and artifacts."""
