"""Test helpers shipped with pdproxy: the mock inference engine.

Run one with ``pdproxy mock-engine --port 8001``, or in-process::

    from pdproxy.testing import MockEngine

    async with MockEngine(model="m") as engine:
        print(engine.url)
"""

from .command import mock_engine_command
from .faults import FAULT_HEADER, Faults, parse_faults
from .mock_engine import MockEngine, build_app
from .mock_settings import MockSettings

__all__ = ["FAULT_HEADER", "Faults", "MockEngine", "MockSettings", "build_app", "mock_engine_command", "parse_faults"]
