"""What agents use: tools, structured outputs and logprobs, through the official ``openai``
package against a real in-process node serving the default model (SmolLM2-135M-Instruct,
Transformers engine, CPU, float32), plus the engine-independent parts without a model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import trio

from peerinfer.core.messages import ChatMessage, Constraint, SamplingParams
from peerinfer.engine.audit import audit_answer
from peerinfer.engine.base import Tokens
from peerinfer.engine.constraints import check_constraint
from peerinfer.engine.tools import generic_messages, parse_tool_calls, tool_call_grammar
from peerinfer.errors import InvalidRequestError
from peerinfer.node import Node
from peerinfer.serve import serve_node
from peerinfer.testing.inprocess import open_nodes
from tests.http.test_http import in_thread, nodes, options, sdk

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                       "required": ["zone"]},
    },
}


# ----------------------------------------------------------------------- without a model


def test_the_generic_format_renders_tools_calls_and_results() -> None:
    tools = json.dumps([WEATHER])
    calls = json.dumps([{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    chat = generic_messages([
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Oslo?"),
        ChatMessage("assistant", "", tool_calls=calls),
        ChatMessage("tool", "12 degrees", tool_call_id="call_1"),
    ], tools)
    assert [m.role for m in chat] == ["system", "user", "assistant", "user"]
    assert chat[0].content.startswith("Be brief.") and '"name": "get_weather"' in chat[0].content
    assert chat[2].content == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert chat[3].content == "<tool_response>\n12 degrees\n</tool_response>"
    # A plain chat is left alone.
    plain = [ChatMessage("user", "hi")]
    assert generic_messages(plain) == plain


def test_tool_calls_are_read_back_only_when_they_parse() -> None:
    names = ["get_weather"]
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    content, calls = parse_tool_calls(text, names)  # type: ignore[misc]
    assert content == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert parse_tool_calls("no call here", names) is None
    assert parse_tool_calls('<tool_call>{"name": "other", "arguments": {}}</tool_call>', names) is None
    assert parse_tool_calls("<tool_call>{broken</tool_call>", names) is None
    # A closing tag inside an argument string does not end the call.
    tricky = '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}</tool_call>'
    assert json.loads(parse_tool_calls(tricky, names)[1][0].arguments) == {"city": "a</tool_call>b"}  # type: ignore[index]
    two = tricky + "\n" + tricky
    assert len(parse_tool_calls(two, names)[1]) == 2  # type: ignore[index]
    assert parse_tool_calls(tricky + " and then some text", names) is None


def test_bad_schemas_and_grammars_are_named() -> None:
    with pytest.raises(InvalidRequestError, match="foo"):
        check_constraint(Constraint("json_schema", json.dumps({"type": "foo"})))
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        check_constraint(Constraint("json_schema", "{nope"))
    grammar = tool_call_grammar([WEATHER["function"], TIME["function"]], parallel=True)  # type: ignore[list-item]
    assert check_constraint(Constraint("lark", grammar))


async def test_invalid_tools_and_formats_get_400_naming_the_problem() -> None:
    async with nodes(1) as (node,):
        client = sdk(node)
        base: dict[str, Any] = dict(model="simulated", messages=[{"role": "user", "content": "hi"}])
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
             "wat", "response_format"),
            ({"response_format": {"type": "yaml"}}, "yaml", "response_format"),
            ({"tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "wat"}}}}}]},
             "wat", "tools[0].function.parameters"),
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "nope", "tool_choice"),
            ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name", "tools[0]"),
            ({"tool_choice": "required"}, "needs tools", "tool_choice"),
            ({"top_logprobs": 3}, "needs logprobs", "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "between 0 and 20", "top_logprobs"),
        ]
        for extra, word, param in cases:
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(lambda extra=extra: client.chat.completions.create(**base, **extra))
            assert word in info.value.message, (extra, info.value.message)
            body: Any = info.value.body
            assert body["param"] == param, body


# ----------------------------------------------------------------------- the default model


@asynccontextmanager
async def smol_node() -> AsyncIterator[Node]:
    import torch

    from peerinfer.engine.hf import TransformersEngine

    threads = torch.get_num_threads()
    engine = TransformersEngine(device="cpu", dtype="float32", threads=1)
    try:
        async with open_nodes(1, lambda i, bootstrap: Node(options(engine="hf"), engine=engine)) as (node,):
            yield node
    finally:
        engine.close()
        torch.set_num_threads(threads)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: Literal["France", "Germany", "Italy", "Spain"]
    population_millions: float = pydantic.Field(ge=0, le=50)
    landmarks: list[Annotated[str, pydantic.Field(max_length=40)]] = pydantic.Field(max_length=3)


def _chat(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


@pytest.mark.slow
async def test_agents_on_the_default_model() -> None:
    """One node, one model load, every agent feature (the load is the expensive part)."""
    async with smol_node() as node:
        client = sdk(node)
        client = client.with_options(timeout=600)
        model = node.engine.model_name  # type: ignore[union-attr]

        # Structured output with the SDK's parse helper (strict json_schema), greedy and sampled.
        for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
            done = await in_thread(lambda extra=extra: client.chat.completions.parse(
                model=model, messages=_chat("Describe Paris as JSON."), response_format=City,
                max_tokens=120, **extra))
            city = done.choices[0].message.parsed
            assert isinstance(city, City), done.choices[0].message.content
            assert done.choices[0].finish_reason == "stop"

        # json_object, streamed: the pieces make one JSON object.
        stream = await in_thread(lambda: list(client.chat.completions.create(
            model=model, messages=_chat("Give a JSON object with a key 'a'."), max_tokens=100,
            temperature=0, response_format={"type": "json_object"}, stream=True)))
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert isinstance(json.loads(text), dict), text

        # tool_choice required: the call parses and matches the parameter schema.
        params_schema = WEATHER["function"]["parameters"]  # type: ignore[index]
        question = _chat("What is the weather in Lyon?")
        answer = await in_thread(lambda: client.chat.completions.create(
            model=model, messages=question, tools=[WEATHER, TIME], tool_choice="required",
            temperature=0, parallel_tool_calls=False, max_tokens=80))
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        call = choice.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        schema = params_schema if call.function.name == "get_weather" else TIME["function"]["parameters"]  # type: ignore[index]
        jsonschema.validate(arguments, schema)

        # A named function, streamed: the SDK assembles the delta.tool_calls chunks.
        chunks = await in_thread(lambda: list(client.chat.completions.create(
            model=model, messages=question, tools=[WEATHER, TIME], max_tokens=80, stream=True,
            temperature=0.7, seed=3,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].function.name == "get_weather" and deltas[0].id
        streamed_args = "".join(d.function.arguments or "" for d in deltas)
        jsonschema.validate(json.loads(streamed_args), params_schema)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # The round trip: the call, the tool's result, the final answer.
        history = [*question, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}]
        final = await in_thread(lambda: client.chat.completions.create(
            model=model, messages=history, tools=[WEATHER, TIME], tool_choice="none",
            temperature=0, max_tokens=16))
        assert final.choices[0].message.content and not final.choices[0].message.tool_calls

        # Logprobs: OpenAI's shape, the top alternatives sorted, the token first among equals.
        lp = await in_thread(lambda: client.chat.completions.create(
            model=model, messages=_chat("Say hello."), max_tokens=8, temperature=0,
            logprobs=True, top_logprobs=5))
        content = lp.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content and "".join(e.token for e in content) == lp.choices[0].message.content
        for entry in content:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 5 and tops == sorted(tops, reverse=True)
            assert entry.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy: the best token
            assert entry.bytes == list(entry.token.encode())
        streamed = await in_thread(lambda: list(client.chat.completions.create(
            model=model, messages=_chat("Say hello."), max_tokens=8, temperature=0,
            logprobs=True, top_logprobs=5, stream=True)))
        streamed_entries = [e for c in streamed if c.choices and c.choices[0].logprobs
                            for e in c.choices[0].logprobs.content or []]
        # (the second run reuses the cached prompt: the same numbers up to rounding)
        assert [e.token for e in streamed_entries] == [e.token for e in content]
        assert [e.logprob for e in streamed_entries] == pytest.approx(
            [e.logprob for e in content], abs=1e-4)
        done_c = await in_thread(lambda: client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
            logprobs=3))
        legacy = done_c.choices[0].logprobs
        assert legacy is not None and len(legacy.tokens) == len(legacy.token_logprobs) == 4  # type: ignore[arg-type]
        assert all(len(t) <= 3 for t in legacy.top_logprobs)  # type: ignore[union-attr]

        # Logprobs equal the model's own log-softmax (teacher-forced, float32) within 1e-4.
        def logprob_gap() -> float:
            import torch

            engine: Any = node.engine
            prompt = engine.chat_prompt_tokens([ChatMessage("user", "Name three colors.")])
            params = SamplingParams(max_tokens=12, logprobs=True, top_logprobs=20,
                                    constraint=Constraint("json_object"))
            entries = [e for ev in engine.generate(prompt, params) if isinstance(ev, Tokens)
                       for e in ev.logprobs]
            ids = [e.token_id for e in entries]
            with torch.inference_mode():
                logits = engine.model(input_ids=torch.tensor([prompt + ids])).logits[0]
            reference = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
            gap = 0.0
            for i, e in enumerate(entries):
                gap = max(gap, abs(e.logprob - float(reference[i, e.token_id])))
                for t in e.top:
                    gap = max(gap, abs(t.logprob - float(reference[i, t.token_id])))
            assert len(entries) == 12 and len(entries[0].top) == 20
            return gap

        assert await node.ctx.in_engine(logprob_gap) < 1e-4

        # The audit re-scores under the constraint: the honest answer passes; the free answer
        # (what a peer ignoring the constraint returns) is caught.
        def audits() -> tuple[Any, Any]:
            engine: Any = node.engine
            prompt = engine.chat_prompt_tokens([ChatMessage("user", "Describe Paris as JSON.")])
            schema = City.model_json_schema()
            constrained = SamplingParams(max_tokens=60, constraint=Constraint(
                "json_schema", json.dumps(schema)))
            honest = [t for ev in engine.generate(prompt, constrained) if isinstance(ev, Tokens)
                      for t in ev.token_ids]
            free = [t for ev in engine.generate(prompt, SamplingParams(max_tokens=20))
                    if isinstance(ev, Tokens) for t in ev.token_ids]
            return (audit_answer(engine, prompt, constrained, honest),
                    audit_answer(engine, prompt, constrained, free))

        # A request resumed after tokens served elsewhere: its constraint starts after them.
        def resumed() -> tuple[list[int], list[int]]:
            engine: Any = node.engine
            prompt = engine.chat_prompt_tokens([ChatMessage("user", "Describe Rome as JSON.")])
            params = SamplingParams(max_tokens=60, constraint=Constraint(
                "json_schema", json.dumps(City.model_json_schema())))
            whole = [t for ev in engine.generate(prompt, params) if isinstance(ev, Tokens)
                     for t in ev.token_ids]
            k = len(whole) // 2
            later = SamplingParams(max_tokens=60 - k, constraint=Constraint(
                "json_schema", json.dumps(City.model_json_schema()), consumed=tuple(whole[:k])))
            rest = [t for ev in engine.generate(prompt + whole[:k], later)
                    if isinstance(ev, Tokens) for t in ev.token_ids]
            return whole[k:], rest

        expected_rest, rest = await node.ctx.in_engine(resumed)
        assert rest == expected_rest

        # A chat template that renders tools itself is used as is (Hermes/Qwen convention).
        def native() -> str:
            engine: Any = node.engine
            saved = engine.tokenizer.chat_template
            engine.tokenizer.chat_template = (
                "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}"
                "</tools> use <tool_call>{% endif %}{% for m in messages %}[{{ m.role }}]"
                "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
                "{{ c.function.arguments.city }}{% endfor %}{% endif %}{{ m.content }}"
                "{% endfor %}[assistant]")
            try:
                calls = json.dumps([{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
                ids = engine.chat_prompt_tokens([
                    ChatMessage("user", "Weather?"), ChatMessage("assistant", "", calls),
                    ChatMessage("tool", "sunny", tool_call_id="c1")], json.dumps([WEATHER]))
                return str(engine.detokenize(ids))
            finally:
                engine.tokenizer.chat_template = saved

        rendered = await node.ctx.in_engine(native)
        assert rendered == ("<tools>get_weather;</tools> use <tool_call>[user]Weather?"
                            "[assistant]CALL get_weatherOslo[tool]sunny[assistant]")

        honest_verdict, free_verdict = await node.ctx.in_engine(audits)
        assert honest_verdict.ok, honest_verdict.describe()
        assert not free_verdict.ok and free_verdict.broke_constraint, free_verdict.describe()


@pytest.mark.slow
async def test_constrained_requests_are_forwarded_audited_and_served_to_the_client() -> None:
    """Two nodes with the default model, round-robin routing: the peerinfer client's JSON-schema
    and logprobs requests go to both; the forwarded ones carry the constraint on the wire (the
    answer is schema-valid JSON with logprobs) and the origin audits them under it, honestly."""
    import torch

    from peerinfer.client import Client
    from peerinfer.engine.hf import TransformersEngine

    threads = torch.get_num_threads()
    engines = [TransformersEngine(device="cpu", dtype="float32", threads=1) for _ in range(2)]
    schema = City.model_json_schema()
    try:
        async with trio.open_nursery() as nursery:
            a = Node(options(engine="hf", policy="round_robin", audit_rate=1.0), engine=engines[0])
            await nursery.start(serve_node, a)
            b = Node(options(engine="hf", policy="round_robin", audit_rate=1.0,
                             bootstrap=(a.addresses()[0],)), engine=engines[1])
            await nursery.start(serve_node, b)
            with trio.fail_after(60):
                while not b.status().peers:
                    await trio.sleep(0.05)
            served: set[str] = set()
            async with Client.connect(b.addresses()[0]) as client:
                for i in range(4):
                    result = await client.generate(
                        [{"role": "user", "content": f"Describe city number {i} as JSON."}],
                        max_tokens=100, json_schema=schema, logprobs=2)
                    jsonschema.validate(json.loads(result.text), schema)
                    assert result.finish_reason == "stop"
                    assert result.logprobs and all(len(e.top) == 2 for e in result.logprobs)
                    assert "".join(e.text for e in result.logprobs) == result.text
                    served.add(result.served_by)
            assert served == {a.peer_id, b.peer_id}
            with trio.fail_after(120):
                while b.trust.audits_run < 1:
                    await trio.sleep(0.05)
            assert b.trust.audits_failed == 0
            nursery.cancel_scope.cancel()
    finally:
        for engine in engines:
            engine.close()
        torch.set_num_threads(threads)
