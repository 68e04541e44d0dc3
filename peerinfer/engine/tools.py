"""Tool calling in peerinfer's generic format: rendering, the call grammar, parsing.

A model whose chat template knows no tools (SmolLM2's does not) is shown them, and its calls
and their results, in one documented format, the Hermes convention that Qwen 2.5, Hermes and
SmolLM3 were trained on (llama.cpp's server does the same for models without a native format):

* the tools are listed in a system message, one JSON object per line inside ``<tools>``, with
  the instruction to answer a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (:data:`TOOLS_PREAMBLE`); a system message of the chat comes first, the tools after it;
* an assistant message's ``tool_calls`` are rendered in that same form after its content;
* a ``tool`` message (a call's result) becomes a user turn
  ``<tool_response>\\n...\\n</tool_response>``.

A model's output is read back with :func:`parse_tool_calls`. Under ``tool_choice`` ``required``
or a named function the output is generated under :func:`tool_call_grammar` (a Lark grammar
embedding each function's parameter schema), so it always parses and validates; under ``auto``
the model is free and its output is a call only if it parses as one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from peerinfer.core.messages import ChatMessage
from peerinfer.engine.constraints import JSON_LAYOUT
from peerinfer.errors import InvalidRequestError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def tool_functions(tools: str | Sequence[Any]) -> list[dict[str, Any]]:
    """The ``function`` objects of OpenAI's ``tools`` list (JSON text or parsed)."""
    items = json.loads(tools) if isinstance(tools, str) else tools
    if not items:
        return []
    out = []
    for tool in items:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise InvalidRequestError("each tool needs a 'function' object")
        out.append(dict(tool["function"]))
    return out


def _call_text(name: str, arguments: Any) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


def _arguments_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def generic_messages(messages: Sequence[ChatMessage], tools: str = "") -> list[ChatMessage]:
    """``messages`` with tools, calls and results rendered as plain text (see the docstring);
    plain chats come back unchanged."""
    functions = tool_functions(tools) if tools else []
    has_tool_parts = any(m.tool_calls or m.role == "tool" for m in messages)
    if not functions and not has_tool_parts:
        return list(messages)
    out: list[ChatMessage] = []
    rest = list(messages)
    if functions:
        listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
        preamble = TOOLS_PREAMBLE.format(tools=listing)
        if rest and rest[0].role == "system":
            out.append(ChatMessage("system", f"{rest[0].content}\n\n{preamble}"))
            rest = rest[1:]
        else:
            out.append(ChatMessage("system", preamble))
    for m in rest:
        if m.role == "tool":
            out.append(ChatMessage("user", f"<tool_response>\n{m.content}\n</tool_response>"))
        elif m.tool_calls:
            calls = []
            for call in json.loads(m.tool_calls):
                function = call.get("function", {}) if isinstance(call, Mapping) else {}
                calls.append(_call_text(str(function.get("name", "")),
                                        _arguments_value(function.get("arguments", {}))))
            text = "\n".join(calls)
            out.append(ChatMessage(m.role, f"{m.content}\n{text}" if m.content else text))
        else:
            out.append(ChatMessage(m.role, m.content))
    return out


def tool_call_grammar(functions: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one call (or, with
    ``parallel``, one or more calls, a newline apart) of one of ``functions``, each an object
    ``{"name": <its name>, "arguments": <matching its parameters schema>}`` in the tags."""
    if not functions:
        raise InvalidRequestError("tool_choice asks for a call but no tools are given")
    options = []
    for f in functions:
        parameters = f.get("parameters") or {"type": "object"}
        options.append({
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": JSON_LAYOUT}
    body = json.dumps(schema, separators=(",", ":"))
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{CALL_OPEN}" %json {body} "{CALL_CLOSE}"\n'


def parse_tool_calls(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]] | None:
    """``(content before the calls, calls)`` if ``text`` holds tool calls of known functions
    whose arguments are JSON objects; None when it is an ordinary answer.

    Each call is read as JSON right after its ``<tool_call>`` tag (so a ``</tool_call>`` inside
    an argument string does not end it), then its closing tag; calls may be separated by
    whitespace; a last call whose closing tag is missing (the model ended there) is accepted.
    """
    start = text.find(CALL_OPEN)
    if start < 0:
        return None
    decoder = json.JSONDecoder()
    calls = []
    at = start
    while at < len(text):
        if not text.startswith(CALL_OPEN, at):
            return None
        try:
            call, end = decoder.raw_decode(text, _skip_space(text, at + len(CALL_OPEN)))
        except ValueError:
            return None
        if (not isinstance(call, dict) or call.get("name") not in names
                or not isinstance(call.get("arguments", {}), dict)):
            return None
        calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}))))
        at = _skip_space(text, end)
        if text.startswith(CALL_CLOSE, at):
            at = _skip_space(text, at + len(CALL_CLOSE))
        elif at < len(text):
            return None
    return text[:start].strip(), calls


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def could_become_call(text: str) -> bool:
    """Whether streamed ``text`` may still turn out to start a tool call (hold it back)."""
    stripped = text.lstrip()
    return CALL_OPEN.startswith(stripped) or stripped.startswith(CALL_OPEN)


__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "TOOLS_PREAMBLE",
    "ToolCall",
    "could_become_call",
    "generic_messages",
    "parse_tool_calls",
    "tool_call_grammar",
    "tool_functions",
]
