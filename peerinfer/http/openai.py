"""OpenAI's API shapes <-> peerinfer messages: pure functions, no I/O.

Requests: :func:`parse_chat` and :func:`parse_completion` turn a decoded JSON body into a
``GenerateRequest`` plus the few response options (``stream``, ``include_usage``), or raise
:class:`ApiError` with OpenAI's error fields. What peerinfer cannot do (``n`` > 1, tools,
logprobs, penalties, ``echo``, ``suffix``...) is refused by name, never silently ignored.
Responses: ``*_response`` (the whole answer), ``*_chunk`` (one SSE event), :func:`usage`,
:func:`error_body`. Error statuses come from the one error table (``peerinfer.errors``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from peerinfer.core.messages import (
    ChatMessage,
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    SamplingParams,
    decode,
    encode,
)
from peerinfer.errors import ProtocolError, error_kind

#: Completion length when the request names none (OpenAI's default is "up to the context").
DEFAULT_MAX_TOKENS = 256
#: Stop sequences OpenAI accepts at most.
MAX_STOP = 4


class ApiError(Exception):
    """An HTTP API error in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def api_error_from(message: ErrorMessage) -> ApiError:
    """A node's ``ErrorMessage`` as an HTTP error, through the one error table."""
    kind = error_kind(message.code)
    return ApiError(kind.http_status, message.message or kind.reason, type=kind.openai_type,
                    code=message.code)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A request the node can take, and how to answer it."""

    request: GenerateRequest
    model: str
    stream: bool
    include_usage: bool


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported by peerinfer", param=param,
                    code="unsupported_parameter")


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(f"{name} must be a number", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"{name} must be an integer", name)
    return value


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _unsupported("n", "n > 1 (several choices per request)")
    for name in ("tools", "functions"):
        if body.get(name):
            raise _unsupported(name, "tool and function calling")
    if body.get("tool_choice") not in (None, "none"):
        raise _unsupported("tool_choice", "tool and function calling")
    if body.get("function_call") not in (None, "none"):
        raise _unsupported("function_call", "tool and function calling")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") is not None:
        raise _unsupported("logprobs", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, name.replace("_", " "))
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise _unsupported("response_format", "a response_format other than text")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _unsupported("best_of", "best_of > 1")
    if body.get("echo"):
        raise _unsupported("echo", "echo")
    if body.get("suffix"):
        raise _unsupported("suffix", "suffix (insertion)")


def _params(body: Mapping[str, Any]) -> SamplingParams:
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise _invalid("max_tokens must be at least 1", "max_tokens")
    temperature = _number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _invalid("temperature must be between 0 and 2", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _invalid("top_p must be in (0, 1]", "top_p")
    seed = _integer(body, "seed")
    if seed is not None and seed < 0:
        raise _invalid("seed must be >= 0", "seed")
    stop_field = body.get("stop")
    if stop_field is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_field, str):
        stop = (stop_field,)
    elif isinstance(stop_field, list) and all(isinstance(s, str) for s in stop_field):
        stop = tuple(stop_field)
    else:
        raise _invalid("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise _invalid(f"stop takes at most {MAX_STOP} sequences", "stop")
    if any(not s for s in stop):
        raise _invalid("stop sequences must not be empty", "stop")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop
    )


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise _invalid("stream_options must be an object", "stream_options")
        if not stream:
            raise _invalid("stream_options is only allowed with stream: true", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    return stream, include_usage


def _check_model(body: Mapping[str, Any], served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model is required (GET /v1/models lists it)", "model")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist here; this network serves "
                       f"{served!r}", param="model", code="model_not_found")
    return model


def _validated(request: GenerateRequest) -> GenerateRequest:
    # The wire schema is the one definition of what a node accepts.
    try:
        decode(encode(request), expected=GenerateRequest)
    except ProtocolError as exc:
        raise _invalid(str(exc).removeprefix("invalid GenerateRequest: ")) from None
    return request


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise _unsupported(f"messages[{index}].content",
                                   "content other than text (images, audio, files)")
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid("a text content part needs a string 'text'",
                               f"messages[{index}].content")
            parts.append(text)
        return "".join(parts)
    if content is None:
        return ""
    raise _invalid("message content must be a string or a list of parts",
                   f"messages[{index}].content")


def parse_chat(body: Any, request_id: str, served_model: str) -> ParsedRequest:
    """``POST /v1/chat/completions`` body -> what to submit. Raises ``ApiError``."""
    if not isinstance(body, Mapping):
        raise _invalid("the request body must be a JSON object")
    model = _check_model(body, served_model)
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty list", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _invalid("each message needs a 'role' and a 'content'", f"messages[{i}]")
        if m.get("tool_calls") or m["role"] in ("tool", "function"):
            raise _unsupported(f"messages[{i}]", "tool and function calling")
        role = "system" if m["role"] == "developer" else m["role"]
        chat.append(ChatMessage(role, _content_text(m.get("content"), i)))
    stream, include_usage = _stream_options(body)
    request = GenerateRequest(request_id=request_id, params=_params(body), messages=tuple(chat))
    return ParsedRequest(_validated(request), model, stream, include_usage)


def parse_completion(body: Any, request_id: str, served_model: str) -> ParsedRequest:
    """``POST /v1/completions`` body -> what to submit. Raises ``ApiError``."""
    if not isinstance(body, Mapping):
        raise _invalid("the request body must be a JSON object")
    model = _check_model(body, served_model)
    _refuse_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    stream, include_usage = _stream_options(body)
    params = _params(body)
    if isinstance(prompt, str):
        if not prompt:
            raise _invalid("the prompt is empty", "prompt")
        request = GenerateRequest(request_id=request_id, params=params, prompt=prompt)
    elif isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        request = GenerateRequest(request_id=request_id, params=params, tokens=tuple(prompt))
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _unsupported("prompt", "several prompts in one request")
    else:
        raise _invalid("prompt must be a string or a list of token ids", "prompt")
    return ParsedRequest(_validated(request), model, stream, include_usage)


# -------------------------------------------------------------------------------- responses


def finish_reason(reason: str) -> str:
    # "cancelled" never reaches a client that is still listening; anything else stopped early.
    return "length" if reason == "length" else "stop"


def usage(done: GenerateDone) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def chat_response(rid: str, model: str, text: str, done: GenerateDone,
                  created: int | None = None) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason(done.finish_reason),
        }],
        "usage": usage(done),
        "system_fingerprint": None,
    }


def completion_response(rid: str, model: str, text: str, done: GenerateDone,
                        created: int | None = None) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason(done.finish_reason),
        }],
        "usage": usage(done),
        "system_fingerprint": None,
    }


def chat_chunk(rid: str, model: str, created: int, *, content: str | None = None,
               role: bool = False, finish: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def completion_chunk(rid: str, model: str, created: int, *, text: str = "",
                     finish: str | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def usage_chunk(rid: str, model: str, created: int, done: GenerateDone,
                chat: bool) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created, "model": model, "choices": [], "usage": usage(done),
    }


def sse(data: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``data`` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_list(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "peerinfer"}],
    }


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "SSE_DONE",
    "ApiError",
    "ParsedRequest",
    "api_error_from",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "error_body",
    "finish_reason",
    "models_list",
    "parse_chat",
    "parse_completion",
    "sse",
    "usage",
    "usage_chunk",
]
