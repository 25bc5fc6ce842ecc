"""What a peer router's command line asks of pdproxy, gathered flag by flag (``rules``) and
then written as the ``pdproxy serve`` arguments that do it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdproxy.cli import options_of
from pdproxy.config.settings import FIELDS, Settings

__all__ = ["Plan", "Refused", "Worker"]


class Refused(Exception):
    """A flag pdproxy will not take: its one-line reason."""

    def __init__(self, flag: str, reason: str) -> None:
        super().__init__(f"{flag}: {reason}")
        self.flag = flag
        self.reason = reason


@dataclass(frozen=True)
class Worker:
    """A worker the command line names, as a pdproxy node."""

    url: str
    role: str = "hybrid"
    bootstrap_port: int | None = None

    def node(self) -> str:
        """The ``--node`` word of it."""
        attributes = [f"role={self.role}"] if self.role != "hybrid" else []
        if self.bootstrap_port is not None:
            attributes.append(f"bootstrap_port={self.bootstrap_port}")
        return ",".join((self.url, *attributes))


@dataclass
class Plan:
    """The reading of one command line: the pdproxy settings it comes to, its workers, and a
    note for every flag taken without an effect of its own."""

    router: str
    #: What the command line gave, by the peer's dest, as the peer's parser read it.
    given: dict[str, object]
    settings: dict[str, object] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: The peer's policies by role (``policy``, ``prefill_policy``, ``decode_policy``), as named.
    policies: dict[str, str] = field(default_factory=dict)
    #: The PD protocol a PD flag turned on (``sglang``, ``vllm``, ``lmdeploy``), if any.
    pd_protocol: str | None = None

    def set(self, name: str, value: object) -> None:
        if name not in FIELDS:
            raise KeyError(f"no pdproxy setting {name!r}")  # a rule's mistake, not the user's
        self.settings[name] = value

    def note(self, flag: str, why: str) -> None:
        self.notes.append(f"{flag}: {why}")

    def serve_args(self) -> list[str]:
        """The ``pdproxy serve`` arguments of the plan."""
        flags = {option.name: option.flags[0] for option in options_of(Settings)}
        args: list[str] = [f"--node={worker.node()}" for worker in self.workers]
        for name, value in self.settings.items():
            if isinstance(value, bool):
                if value:
                    args.append(flags[name])
            elif isinstance(value, tuple | list):
                args += [f"{flags[name]}={item}" for item in value]
            else:
                args.append(f"{flags[name]}={value}")
        return args
