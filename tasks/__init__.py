"""ortforge build stages: one module per stage, each a pure run() plus a `python -m` entry point."""
