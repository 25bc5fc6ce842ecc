"""`scripts/check_public_any.py` (run by `make lint-python`): pdproxy's public signatures hold no
`typing.Any`, and the check finds one wherever it would hide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servers import REPO

ROOT = REPO
CHECK = ROOT / "scripts" / "check_public_any.py"


def check(package: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(CHECK), *([str(package)] if package is not None else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def test_the_package_has_no_any_in_public_signatures() -> None:
    result = check()
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("from typing import Any\ndef f(x: Any) -> None: ...\n", "f"),
        ("from typing import Any\nasync def f() -> list[Any]: ...\n", "f"),
        ("from typing import Any\ndef f(**kw: Any) -> None: ...\n", "f"),
        ("from typing import Any\ndef f(x: 'dict[str, Any]') -> None: ...\n", "f"),
        ("import typing\ndef f(x: typing.Any) -> None: ...\n", "f"),
        ("from typing import Any as A\ndef f() -> A: ...\n", "f"),
        ("from typing import Any\nclass C:\n    def __init__(self, *a: Any) -> None: ...\n", "C.__init__"),
        ("from typing import Any\nclass C:\n    field: dict[str, Any]\n", "C.field"),
        ("from typing import Any\nclass C:\n    class D:\n        def m(self) -> Any: ...\n", "C.D.m"),
        ("from typing import Any\nScope = dict[str, Any]\n", "Scope"),
        ("from typing import Any, TypeAlias\nScope: TypeAlias = 'dict[str, Any]'\n", "Scope"),
        ("from typing import Any, TypeVar\nF = TypeVar('F', bound=Any)\n", "F"),
    ],
)
@pytest.mark.parametrize("file_name", ["module.py", "_stub.pyi"])
def test_an_any_in_a_public_signature_is_named(tmp_path: Path, source: str, name: str, file_name: str) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / file_name).write_text(source)
    result = check(tmp_path)
    assert result.returncode == 1
    assert f"{file_name}:" in result.stderr
    assert f": {name}: typing.Any in a public signature" in result.stderr


@pytest.mark.parametrize(
    "source",
    [
        "from typing import Any\ndef _f(x: Any) -> None: ...\n",
        "from typing import Any\nclass _C:\n    def m(self, x: Any) -> None: ...\n",
        "from typing import Any\nclass C:\n    def _m(self, x: Any) -> None: ...\n",
        "from typing import Any\ndef f() -> None:\n    x: dict[str, Any] = {}\n",
        "from typing import Any\n_Scope = dict[str, Any]\n",
        "def f(x: object) -> dict[str, object]: ...\n",
    ],
)
def test_private_names_and_function_bodies_may_use_any(tmp_path: Path, source: str) -> None:
    (tmp_path / "module.py").write_text(source)
    result = check(tmp_path)
    assert result.returncode == 0, result.stderr
