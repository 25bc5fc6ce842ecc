"""vLLM's disaggregated prefill (NixlConnector and its kin), as vLLM's reference proxy does it
and better: the prefill runs first with ``kv_transfer_params.do_remote_decode`` and
``max_tokens=1``; the ``kv_transfer_params`` of its answer go to the decode node byte for byte;
both legs carry the same ``X-Request-Id``. A prefill that returns no params (its one token was
the end) still completes: decode then computes the prompt itself. The engines free the KV (the
decode's read notifies the prefill, or the prefill's lease runs out): no ledger is needed."""

from __future__ import annotations

from typing import TypedDict

from pdproxy import _pdproxy
from pdproxy._pdproxy import Router as CoreRouter
from pdproxy.config import Settings
from pdproxy.errors import InvalidPrefillAnswer, InvalidRequest
from pdproxy.router import Router
from pdproxy.tracing import end_on_answer, leg

from .relay import ApiKeyOf, PdRequest, read_all, relay, send_raw

PD_PATHS = frozenset(_pdproxy.PD_PATHS["vllm"])


class VllmStatus(TypedDict):
    protocol: str


class VllmPD:
    protocol = "vllm"
    paths = PD_PATHS

    def __init__(self, router: Router, settings: Settings, api_key_of: ApiKeyOf) -> None:
        self.router = router
        self.settings = settings

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def node_removed(self, url: str) -> None:
        pass  # nothing held by the proxy

    def status(self) -> VllmStatus:
        return VllmStatus(protocol=self.protocol)

    async def handle(self, request: PdRequest) -> None:
        path, body, headers, send, echo = request.path, request.body, request.headers, request.send, request.echo
        trace, tenant = request.trace, request.tenant
        if (Router.inspect(body)["n"] or 1) > 1:
            raise InvalidRequest("n > 1 is not supported with disaggregated prefill")
        span = leg(trace, "pdproxy.prefill")
        pending = self.router.forward(
            path,
            _pdproxy.pd_prefill_body("vllm", path, body),
            headers,
            role="prefill",
            trace=span or trace,
            tenant=tenant,
        )
        end_on_answer(span, pending)
        answer = await pending
        raw = await read_all(answer, self.settings)
        if answer.status != 200:
            await send_raw(send, answer, raw, echo)  # the prefill's error; decode never runs
            return
        # Verbatim: the raw JSON text of the prefill's params, not a re-encoding of it.
        try:
            params = CoreRouter.member(raw, "kv_transfer_params")
        except InvalidRequest:
            raise InvalidPrefillAnswer("the prefill node's answer is not a JSON object") from None
        decode_body = body if params in (None, "null") else CoreRouter.patch(body, [("kv_transfer_params", params)])
        span = leg(trace, "pdproxy.decode")
        pending = self.router.forward(path, decode_body, headers, role="decode", trace=span or trace, tenant=tenant)
        end_on_answer(span, pending)
        response = await pending
        try:
            await relay(response, send, echo, self.settings)
        finally:
            response.close()
