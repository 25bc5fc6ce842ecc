"""The command line that runs a mock engine in its own process: one spelling for the demo, the
benchmarks and anyone scripting a fleet of mocks."""

from __future__ import annotations

import sys


def mock_engine_command(port: int, model: str, *options: str) -> list[str]:
    """``pdproxy mock-engine`` on ``port`` serving ``model``, run by this interpreter (so it is the
    pdproxy installed here, whatever is on PATH); ``options`` are further ``mock-engine`` flags."""
    return [sys.executable, "-m", "pdproxy", "mock-engine", "--port", str(port), "--model", model, *options]
