"""The mock engine's settings: every default of `pdproxy mock-engine` lives here.

A pydantic model as pdproxy's own ``Settings`` is (strict types, each check beside its field, a
refusal in one line naming the setting), so that the CLI makes both commands' options from one
generator. They are checked once, when the engine is built; requests only read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from pdproxy.config.settings import REFUSED, AtLeastOne, NotNegativeNumber, settings_message
from pdproxy.errors import ConfigError
from pdproxy.kv_events.wire import DIALECTS as KV_EVENT_DIALECTS

from .distserve import ID_FORMATS
from .engine_metrics import DIALECTS
from .faults import FAULT_HELP, ROLES, FaultSpecError, parse_faults

__all__ = ["MockSettings"]


def _one_of(choices: tuple[str, ...]) -> AfterValidator:
    """A text setting that must be one of ``choices``."""

    def check(value: str, info: ValidationInfo) -> str:
        if value not in choices:
            raise PydanticCustomError(REFUSED, f"{info.field_name} must be one of {', '.join(choices)}, got {value!r}")
        return value

    return AfterValidator(check)


def _fault_spec(value: str) -> str:
    try:
        parse_faults(value)  # fail at startup, not per request
    except FaultSpecError as e:
        raise PydanticCustomError(REFUSED, str(e)) from None
    return value


class MockSettings(BaseModel):
    """Every default of the mock engine lives here (`pdproxy mock-engine --help`)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8001, description="Port to listen on (0: any free port).")
    model: str = Field("mock-model", description="Model name served.")
    max_model_len: int = Field(
        4096, description="The context length its /v1/models card reports (playing vLLM, also the most it takes)."
    )
    prompt_tokens_details: bool = Field(
        False, description="Playing vLLM: usage.prompt_tokens_details, as vLLM's --enable-prompt-tokens-details."
    )
    role: Annotated[str, _one_of(ROLES)] = Field("hybrid", description="Engine role: hybrid, prefill or decode.")
    ttft_ms: float = Field(0.0, description="Milliseconds before the first token.")
    token_delay_ms: float = Field(0.0, description="Milliseconds between tokens.")
    fault: Annotated[str, AfterValidator(_fault_spec)] = Field("", description=FAULT_HELP)
    allow_terminate: bool = Field(
        False, description="Let GET /terminate stop the engine (LMDeploy's --allow-terminate-by-client)."
    )
    tp_size: int = Field(1, description="Tensor-parallel size reported by /distserve/engine_info.")
    bootstrap_timeout_ms: float = Field(
        3000.0, description="SGLang: how long prefill and decode wait for each other in a room."
    )
    block_size: int = Field(64, description="Tokens per KV block (DistServe).")
    id_format: Annotated[str, _one_of(ID_FORMATS)] = Field(
        "legacy",
        description="How a prefill answer names its session, as LMDeploy versions did: legacy (id is the "
        "session number), cache_session_id, chat (id chatcmpl-...), completions (id is the request's "
        "session_id, -1 by default).",
    )
    metrics_dialect: Annotated[str, _one_of(DIALECTS)] = Field(
        "lmdeploy",
        description="The engine it plays: lmdeploy, vllm or sglang (its /metrics; as vllm, its answers too).",
    )
    simulate: bool = Field(
        False,
        description="Behave like a serving engine (hybrid role): a paged KV cache with prefix reuse and LRU "
        "eviction, continuous batching with a waiting queue, prefill time from the uncached prompt tokens "
        "and decode steps that grow with the batch (the options below); --ttft-ms and --token-delay-ms do "
        "not apply then.",
    )
    kv_blocks: AtLeastOne = Field(2048, description="Simulation: KV-cache blocks.")
    kv_block_tokens: AtLeastOne = Field(16, description="Simulation: tokens per KV-cache block.")
    max_batch: AtLeastOne = Field(32, description="Simulation: requests running at once (the rest wait).")
    max_step_tokens: AtLeastOne = Field(
        2048, description="Simulation: prompt tokens prefilled per step (chunked prefill)."
    )
    prefill_ms_per_token: NotNegativeNumber = Field(
        0.2, description="Simulation: milliseconds of a step per prompt token prefilled."
    )
    decode_step_ms: NotNegativeNumber = Field(20.0, description="Simulation: milliseconds of every step.")
    decode_step_ms_per_seq: NotNegativeNumber = Field(
        0.5, description="Simulation: milliseconds a step takes longer per request decoding."
    )
    kv_events: str = Field(
        "",
        description="Simulation: publish KV-cache events on this ZMQ endpoint (tcp://127.0.0.1:0: any free "
        "port), as vLLM's --kv-events-config and SGLang's do; /server_info says where.",
    )
    kv_events_replay: str = Field("", description="Simulation: the ZMQ endpoint replaying the KV events it keeps.")
    kv_events_dialect: Annotated[str, _one_of(KV_EVENT_DIALECTS)] = Field(
        "vllm", description="Simulation: the KV events' encoding: vllm, vllm-array or sglang."
    )

    ssl_certfile: str = Field("", description="Serve HTTPS with this certificate chain (PEM; with --ssl-keyfile).")
    ssl_keyfile: str = Field("", description="Serve HTTPS with this private key (PEM).")

    def __init__(self, **values: object) -> None:
        try:
            # Values of any type: checking them is pydantic's job, and a refusal is one line.
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(settings_message(e)) from None

    @model_validator(mode="after")
    def _tls_pair(self) -> MockSettings:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise PydanticCustomError(REFUSED, "ssl_certfile and ssl_keyfile go together")
        return self

    @model_validator(mode="after")
    def _events_follow_the_simulation(self) -> MockSettings:
        if self.kv_events and not self.simulate:
            raise PydanticCustomError(REFUSED, "kv_events needs simulate: the events follow the simulated KV cache")
        return self

    @classmethod
    def of(cls, values: Mapping[str, object], base: MockSettings | None = None) -> MockSettings:
        """Settings with ``values`` (by field name) over ``base``'s, or the defaults; raises
        ``ConfigError`` (a ``ValueError``) for a value it refuses."""
        return cls(**{**(base.model_dump() if base is not None else {}), **values})
