"""The example files a user copies (examples/): each one read by pdproxy itself, so that they
stay true as settings change."""

from __future__ import annotations

import configparser
import json
import shlex
import subprocess
import sys
import tomllib

from pdproxy.config.checks import checked
from pdproxy.config.settings import GROUPS, Settings, flat_name, toml_keys
from servers import REPO

EXAMPLES = REPO / "examples"


def test_the_example_settings_file_loads_and_sets_something_in_every_group() -> None:
    path = EXAMPLES / "pdproxy.toml"
    settings = checked(Settings.from_toml(path))
    written = {toml_keys()[key] for key in tomllib.loads(path.read_text())}
    for group in GROUPS:
        names = {flat_name(name, field) for name, field in group.model_fields.items()}
        assert written & names, f"examples/pdproxy.toml sets nothing under {group.title}"
    assert len(settings.routing.nodes) == 2
    assert "labels.zone=eu" in settings.routing.nodes[1], "a node written as a table"


def test_the_example_unit_starts_pdproxy_with_a_command_line_it_reads() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read(EXAMPLES / "pdproxy.service")
    service = unit["Service"]
    program, *words = shlex.split(service["ExecStart"])
    assert program.endswith("/pdproxy")
    config = words.index("--config")
    words[config + 1] = str(EXAMPLES / "pdproxy.toml")  # where the unit's comment says to copy it
    result = subprocess.run(
        [sys.executable, "-m", "pdproxy", *words, "--print-config"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    drain = json.loads(result.stdout)["drain_timeout"]
    assert float(service["TimeoutStopSec"]) > drain, "systemd must wait longer than the drain it asked for"
    assert service["KillSignal"] == "SIGTERM", "SIGTERM is the signal that drains"
    assert service["RestartPreventExitStatus"] == "2", "a bad setting (exit 2) is not restarted in a loop"
