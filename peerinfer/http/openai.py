"""OpenAI's API shapes <-> peerinfer messages: pure functions, no I/O.

Requests: :func:`parse_chat` and :func:`parse_completion` turn a decoded JSON body into a
``GenerateRequest`` plus the few response options (``stream``, ``include_usage``, the tools
offered, logprobs), or raise :class:`ApiError` with OpenAI's error fields. What peerinfer cannot
do (``n`` > 1, penalties, ``logit_bias``, ``echo``, ``suffix``, the legacy ``functions``...) is
refused by name, never silently ignored.

Agents' features map onto the request like this:

* ``tools`` travel as JSON text in ``GenerateRequest.tools`` and are rendered into the prompt by
  the engine (``Engine.chat_prompt_tokens``: the model's template if it renders tools, else
  peerinfer's generic format, ``peerinfer.engine.tools``), unless ``tool_choice`` is ``none``.
  ``required`` or a named function adds a ``lark`` constraint (``tool_call_grammar``), so the
  call parses and matches its parameter schema; ``auto`` leaves the model free and the answer
  is a call when it parses as one.
* ``response_format`` ``json_object``/``json_schema`` becomes a ``Constraint`` checked here (an
  invalid or unsupported schema: 400 with the grammar library's message).
* ``logprobs``/``top_logprobs`` (chat) or ``logprobs: k`` (completions) ask the engine for the
  raw log-softmax of each token; they come back in ``TokenChunk.logprobs``.

Responses: ``*_response`` (the whole answer), ``*_chunk`` (one SSE event), :func:`usage`,
:func:`error_body`. Error statuses come from the one error table (``peerinfer.errors``).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from peerinfer.core.messages import (
    MAX_TOP_LOGPROBS,
    ChatMessage,
    Constraint,
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    SamplingParams,
    TokenLogprob,
    decode,
    encode,
)
from peerinfer.engine.constraints import check_constraint
from peerinfer.engine.tools import ToolCall, parse_tool_calls, tool_call_grammar
from peerinfer.errors import InvalidRequestError, ProtocolError, error_kind

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
    #: names of the tools whose calls the answer may hold (empty: the answer is text)
    tool_names: tuple[str, ...] = ()
    logprobs: bool = False


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


def _refuse_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _unsupported("n", "n > 1 (several choices per request)")
    if body.get("functions"):
        raise _unsupported("functions", "the legacy 'functions' parameter (use 'tools')")
    if body.get("function_call") not in (None, "none"):
        raise _unsupported("function_call", "the legacy 'function_call' parameter (use 'tool_choice')")
    if not chat:
        for name in ("tools", "tool_choice", "response_format"):
            if body.get(name) is not None:
                raise _unsupported(name, f"{name} on /v1/completions (use /v1/chat/completions)")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, name.replace("_", " "))
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "logit_bias")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _unsupported("best_of", "best_of > 1")
    if body.get("echo"):
        raise _unsupported("echo", "echo")
    if body.get("suffix"):
        raise _unsupported("suffix", "suffix (insertion)")


def _params(body: Mapping[str, Any], constraint: Constraint | None = None,
            logprobs: tuple[bool, int] = (False, 0)) -> SamplingParams:
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
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
        constraint=constraint, logprobs=logprobs[0], top_logprobs=logprobs[1],
    )


def _chat_logprobs(body: Mapping[str, Any]) -> tuple[bool, int]:
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _invalid("logprobs must be a boolean", "logprobs")
    top = _integer(body, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _invalid(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
        if not logprobs:
            raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return bool(logprobs), top or 0


def _completion_logprobs(body: Mapping[str, Any]) -> tuple[bool, int]:
    top = _integer(body, "logprobs")
    if top is None:
        return False, 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _invalid(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
    return True, top


def _checked(constraint: Constraint, param: str) -> Constraint:
    try:
        check_constraint(constraint)
    except InvalidRequestError as exc:
        raise _invalid(str(exc), param) from None
    return constraint


def _response_format(body: Mapping[str, Any]) -> Constraint | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise _invalid("response_format must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise _invalid("response_format.json_schema must be an object with a 'schema' object",
                           "response_format")
        name = spec.get("name")
        if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise _invalid("response_format.json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$",
                           "response_format")
        schema = spec.get("schema") or {"type": "object"}
        return _checked(Constraint("json_schema", json.dumps(schema)), "response_format")
    raise _unsupported("response_format", f"response_format type {kind!r}")


_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class _Tools:
    text: str  # the JSON list for the wire ("" when no tools are offered)
    names: tuple[str, ...]
    constraint: Constraint | None


def _tools(body: Mapping[str, Any]) -> _Tools:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _invalid("tool_choice needs tools", "tool_choice")
        return _Tools("", (), None)
    if not isinstance(tools, list):
        raise _invalid("tools must be a list", "tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise _unsupported(where, "tools other than functions")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise _invalid("a tool needs a 'function' object", where)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid("a function's name must match ^[a-zA-Z0-9_-]{1,64}$", where)
        if any(f["name"] == name for f in functions):
            raise _invalid(f"two tools are named {name!r}", where)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise _invalid("a function's parameters must be a JSON schema object", where)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid("a function's description must be a string", where)
        entry: dict[str, Any] = {"name": name}
        if description:
            entry["description"] = description
        entry["parameters"] = dict(parameters)
        functions.append(entry)
        # Each schema is checked alone, so the error names the function.
        _checked(Constraint("json_schema", json.dumps(dict(parameters))), f"{where}.function.parameters")
    if choice is None or choice == "auto":
        wanted: list[dict[str, Any]] | None = None
    elif choice == "none":
        return _Tools("", (), None)
    elif choice == "required":
        wanted = functions
    elif (isinstance(choice, Mapping) and choice.get("type") == "function"
          and isinstance(choice.get("function"), Mapping)):
        named = choice["function"].get("name")
        wanted = [f for f in functions if f["name"] == named]
        if not wanted:
            raise _invalid(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    else:
        raise _invalid("tool_choice must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    constraint = None
    if wanted is not None:
        # A named function is called once; 'required' may call several when parallel.
        grammar = tool_call_grammar(wanted, parallel=parallel and choice == "required")
        constraint = _checked(Constraint("lark", grammar), "tools")
    text = json.dumps([{"type": "function", "function": f} for f in functions])
    return _Tools(text, tuple(f["name"] for f in functions), constraint)


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


def _tool_calls_text(calls: Any, index: int) -> str:
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise _invalid("tool_calls must be a list", where)
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise _invalid("each tool call needs a 'function' with a 'name'", where)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return json.dumps(out)


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
    _refuse_unsupported(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty list", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _invalid("each message needs a 'role' and a 'content'", f"messages[{i}]")
        if m["role"] == "function":
            raise _unsupported(f"messages[{i}]", "the legacy 'function' role (use 'tool')")
        role = "system" if m["role"] == "developer" else m["role"]
        calls = _tool_calls_text(m["tool_calls"], i) if m.get("tool_calls") else ""
        call_id = m.get("tool_call_id", "")
        if role == "tool" and not isinstance(call_id, str):
            raise _invalid("a tool message needs a string 'tool_call_id'", f"messages[{i}]")
        name = m.get("name", "")
        chat.append(ChatMessage(role, _content_text(m.get("content"), i), calls,
                                str(call_id or "")[:128], name if isinstance(name, str) else ""))
    tools = _tools(body)
    constraint = tools.constraint or _response_format(body)
    logprobs = _chat_logprobs(body)
    stream, include_usage = _stream_options(body)
    request = GenerateRequest(request_id=request_id, params=_params(body, constraint, logprobs),
                              messages=tuple(chat), tools=tools.text)
    return ParsedRequest(_validated(request), model, stream, include_usage, tools.names,
                         logprobs[0])


def parse_completion(body: Any, request_id: str, served_model: str) -> ParsedRequest:
    """``POST /v1/completions`` body -> what to submit. Raises ``ApiError``."""
    if not isinstance(body, Mapping):
        raise _invalid("the request body must be a JSON object")
    model = _check_model(body, served_model)
    _refuse_unsupported(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    stream, include_usage = _stream_options(body)
    logprobs = _completion_logprobs(body)
    params = _params(body, None, logprobs)
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
    return ParsedRequest(_validated(request), model, stream, include_usage, (), logprobs[0])


# -------------------------------------------------------------------------------- responses


def finish_reason(reason: str, tool_calls: bool = False) -> str:
    # "cancelled" never reaches a client that is still listening; anything else stopped early.
    if reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def read_answer(text: str, tool_names: Sequence[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a chat answer: calls only when tools were offered and the
    text parses as calls of them (content then None when nothing came before the calls)."""
    if tool_names:
        parsed = parse_tool_calls(text, tool_names)
        if parsed is not None:
            return parsed[0] or None, parsed[1]
    return text, []


def tool_call_objects(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": "call_" + secrets.token_hex(12), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _token_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object for ``entries``."""
    return {
        "content": [
            {**_token_entry(e.text, e.logprob),
             "top_logprobs": [_token_entry(t.text, t.logprob) for t in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset``: characters before these tokens."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def usage(done: GenerateDone) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def chat_response(rid: str, model: str, text: str, done: GenerateDone,
                  created: int | None = None, *, tool_names: Sequence[str] = (),
                  logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
    content, calls = read_answer(text, tool_names)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = tool_call_objects(calls)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs),
            "finish_reason": finish_reason(done.finish_reason, bool(calls)),
        }],
        "usage": usage(done),
        "system_fingerprint": None,
    }


def completion_response(rid: str, model: str, text: str, done: GenerateDone,
                        created: int | None = None, *,
                        logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs),
            "finish_reason": finish_reason(done.finish_reason),
        }],
        "usage": usage(done),
        "system_fingerprint": None,
    }


def chat_chunk(rid: str, model: str, created: int, *, content: str | None = None,
               role: bool = False, finish: str | None = None,
               tool_calls: list[dict[str, Any]] | None = None,
               logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta,
                     "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                     "finish_reason": finish}],
    }


def tool_call_chunks(calls: Sequence[ToolCall]) -> list[list[dict[str, Any]]]:
    """The ``delta.tool_calls`` of the chunks that stream ``calls``, as OpenAI sends them: per
    call, one delta with its index, id, type and name (empty arguments), then one with the
    arguments (a client concatenates the argument pieces of each index)."""
    out = []
    for i, call in enumerate(tool_call_objects(calls)):
        head = {"index": i, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}
        out.append([head])
        out.append([{"index": i, "function": {"arguments": call["function"]["arguments"]}}])
    return out


def completion_chunk(rid: str, model: str, created: int, *, text: str = "",
                     finish: str | None = None,
                     logprobs: Sequence[TokenLogprob] | None = None,
                     offset: int = 0) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text,
                     "logprobs": None if logprobs is None else completion_logprobs(logprobs, offset),
                     "finish_reason": finish}],
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
    "chat_logprobs",
    "chat_response",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "error_body",
    "finish_reason",
    "models_list",
    "parse_chat",
    "parse_completion",
    "read_answer",
    "sse",
    "tool_call_chunks",
    "tool_call_objects",
    "usage",
    "usage_chunk",
]
