"""The fields vLLM (0.32) puts in its answers beyond OpenAI's, which the mock engine adds when it
plays vLLM (``metrics_dialect="vllm"``): taken from a real vLLM's answers, recorded in
``tests/fixtures/vllm-0.32.0.json`` (the real-engine tier checks the real engine still answers
so, the main suite checks the mock against the same record). All are null here, as vLLM leaves
them unless a request asks for them (logprobs, token ids, KV transfer)."""

from __future__ import annotations

from typing import Final

#: What vLLM's answers carry as `system_fingerprint` (it is never null there).
FINGERPRINT: Final = "fp_pdproxy_mock"

#: A whole answer's own fields, both kinds.
ANSWER: Final = {
    "ec_transfer_params": None,
    "kv_transfer_params": None,
    "metrics": None,
    "service_tier": None,
    "system_fingerprint": FINGERPRINT,
}
#: ... and a chat answer's besides.
CHAT_ANSWER: Final = {"prompt_logprobs": None, "prompt_text": None, "prompt_token_ids": None}
CHAT_CHOICE: Final = {"routed_experts": None, "stop_reason": None, "token_ids": None}
MESSAGE: Final = {"annotations": None, "audio": None, "function_call": None, "reasoning": None, "refusal": None}
COMPLETION_CHOICE: Final = {
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "routed_experts": None,
    "stop_reason": None,
    "token_ids": None,
}
#: A whole answer's usage (the details are null unless --enable-prompt-tokens-details).
USAGE: Final = {"completion_tokens_details": None}

#: Stream chunks: the extra fields of a token's choice (chat: ``token_ids``; text: also the
#: prompt's ``prompt_token_ids`` and ``stop_reason``), the last token's choice, and the first chat
#: chunk's top level (the one with the role and empty content, before any token).
CHAT_TOKEN: Final = ',"token_ids":null'
CHAT_LAST: Final = ',"stop_reason":null,"token_ids":null'
TEXT_TOKEN: Final = ',"stop_reason":null,"token_ids":null,"prompt_token_ids":null'
ROLE_CHUNK_TOP: Final = ',"prompt_text":null,"prompt_token_ids":null'


#: The model card's `permission` entry (vLLM's ModelPermission), with a stable id.
def permission(model: str, created: int) -> dict[str, object]:
    return {
        "id": f"modelperm-{model}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def error(status: int, message: str, param: str) -> dict[str, object]:
    """vLLM's error body: its ``code`` is the HTTP status, its ``type`` the exception's name."""
    kinds = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
    return {"error": {"message": message, "type": kinds.get(status, "BadRequestError"), "param": param, "code": status}}
