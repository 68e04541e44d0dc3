"""Agents on the llama.cpp engine: constrained decoding (each row of a batch its own grammar),
logprobs against llama.cpp's own logits, audits under the constraint, and tools through the
official ``openai`` package against a node on ``--engine llamacpp`` (the default model's GGUF,
SmolLM2-135M-Instruct Q4, CPU, one thread)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import jsonschema
import numpy as np
import pytest

from peerinfer.core.messages import ChatMessage, Constraint, SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine.audit import audit_answer
from peerinfer.engine.base import NEVER_CANCELLED, Finished, Tokens
from peerinfer.engine.batch import BatchScheduler
from peerinfer.engine.constraints import log_softmax_numpy
from peerinfer.engine.llamacpp import LlamaCppEngine
from peerinfer.node import Node
from peerinfer.testing.inprocess import open_nodes
from tests.http.test_agents import TIME, WEATHER, _chat
from tests.http.test_http import in_thread, options, sdk

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["pilot", "chef", "doctor"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
           "minItems": 2, "maxItems": 4}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def smol() -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=16))
    yield engine
    engine.close()


def _prompt(engine: LlamaCppEngine, what: str) -> list[int]:
    return engine.chat_prompt_tokens([ChatMessage("user", f"Give {what} as JSON.")])


def _schema(schema: dict[str, Any], **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=80, constraint=Constraint("json_schema", json.dumps(schema)),
                          **extra)


def _run(engine: LlamaCppEngine, jobs: dict[str, tuple[list[int], SamplingParams]],
         max_running: int) -> dict[str, tuple[list[int], str, str | None]]:
    """Each job's (ids, text, finish reason), run together through the batch scheduler."""
    scheduler = BatchScheduler(engine, max_running=max_running)
    out: dict[str, tuple[list[int], str, str | None]] = {}
    ids: dict[str, list[int]] = {k: [] for k in jobs}
    text = dict.fromkeys(jobs, "")
    finish: dict[str, str | None] = dict.fromkeys(jobs)
    for key, (prompt, params) in jobs.items():
        scheduler.submit(key, prompt, params, NEVER_CANCELLED)
    for _ in range(2000):
        if scheduler.idle:
            break
        for key, event in scheduler.step():
            if isinstance(event, Tokens):
                ids[key].extend(event.token_ids)
                text[key] += event.text
            elif isinstance(event, Finished):
                finish[key] = event.finish_reason
            elif isinstance(event, Exception):
                raise event
    scheduler.close()
    assert scheduler.idle
    for key in jobs:
        out[key] = (ids[key], text[key], finish[key])
    return out


def _generate(engine: LlamaCppEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    events = list(engine.generate(prompt, params))
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop", events[-1]
    toks = [ev for ev in events if isinstance(ev, Tokens)]
    return [t for ev in toks for t in ev.token_ids], "".join(ev.text for ev in toks)


@pytest.mark.slow
def test_schema_answers_are_valid_greedy_and_sampled(smol: LlamaCppEngine) -> None:
    prompt = _prompt(smol, "a person")
    for params in (_schema(PERSON), _schema(PERSON, temperature=1.0, seed=11),
                   _schema(PERSON, temperature=0.8, top_p=0.9, seed=5)):
        _, text = _generate(smol, prompt, params)
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.slow
def test_each_row_of_a_batch_keeps_its_own_constraint(
        smol: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    widths: list[int] = []
    original = smol.decode_batch

    def counted(decoders: Any) -> Any:
        widths.append(len(decoders))
        return original(decoders)

    monkeypatch.setattr(smol, "decode_batch", counted)
    jobs = {
        "person": (_prompt(smol, "a person"), _schema(PERSON)),
        "numbers": (_prompt(smol, "a list of numbers"), _schema(NUMBERS, temperature=0.9, seed=2)),
        "flag": (_prompt(smol, "a flag"), _schema(FLAG)),
        "free": (_prompt(smol, "a person"), SamplingParams(max_tokens=12)),
        "regex": (_prompt(smol, "a date"), SamplingParams(
            max_tokens=20, constraint=Constraint("regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))),
    }
    out = _run(smol, jobs, max_running=5)
    assert max(widths) >= 4, widths  # the rows really shared decode steps
    jsonschema.validate(json.loads(out["person"][1]), PERSON)
    jsonschema.validate(json.loads(out["numbers"][1]), NUMBERS)
    jsonschema.validate(json.loads(out["flag"][1]), FLAG)
    import re

    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out["regex"][1]), out["regex"][1]
    assert out["free"][2] == "length" and out["free"][1]
    for key in ("person", "numbers", "flag", "regex"):
        assert out[key][2] == "stop", (key, out[key])
    # The free row is the one a lone free request gives (greedy): no neighbour's mask leaked.
    alone, _ = _run(smol, {"free": jobs["free"]}, max_running=1)["free"][:2]
    assert out["free"][0] == alone


@pytest.mark.slow
def test_logprobs_are_the_log_softmax_of_llama_cpp_logits(smol: LlamaCppEngine) -> None:
    prompt = _prompt(smol, "three colours")
    for extra in ({}, {"temperature": 0.9, "seed": 4}):
        params = SamplingParams(max_tokens=14, logprobs=True, top_logprobs=20,
                                constraint=Constraint("json_object"), **extra)  # type: ignore[arg-type]
        entries = [e for ev in smol.generate(prompt, params) if isinstance(ev, Tokens)
                   for e in ev.logprobs]
        ids = [e.token_id for e in entries]
        assert len(entries) >= 5 and all(len(e.top) == 20 for e in entries)
        # llama.cpp's own logits, teacher-forced (bit-identical to the decode's: see the
        # engine's docstring on n_ubatch), log-softmaxed in float64.
        reference = smol.scored_logits(prompt + ids, len(prompt))
        gap = 0.0
        for i, e in enumerate(entries):
            lps = log_softmax_numpy(reference[i])
            gap = max(gap, abs(e.logprob - lps[e.token_id]))
            tops = [t.logprob for t in e.top]
            assert tops == sorted(tops, reverse=True)
            assert [t.token_id for t in e.top][:5] == list(np.argsort(-lps, kind="stable")[:5])
            for t in e.top:
                gap = max(gap, abs(t.logprob - lps[t.token_id]))
        assert gap < 1e-4, gap
        if not extra:  # greedy under a mask: the chosen token is at most the raw best
            assert all(e.logprob <= e.top[0].logprob + 1e-9 for e in entries)


@pytest.mark.slow
def test_audit_rescores_under_the_constraint(smol: LlamaCppEngine) -> None:
    prompt = _prompt(smol, "a person")
    greedy = _schema(PERSON)
    honest, _ = _generate(smol, prompt, greedy)
    verdict = audit_answer(smol, prompt, greedy, honest)
    assert verdict is not None and verdict.ok and verdict.scored_tokens, verdict
    sampled = _schema(PERSON, temperature=0.9, top_p=0.9, seed=8)
    honest_sampled, _ = _generate(smol, prompt, sampled)
    verdict = audit_answer(smol, prompt, sampled, honest_sampled)
    assert verdict is not None and verdict.ok, verdict.describe()
    # A peer that ignored the constraint: caught, at the first token the grammar forbids.
    free = [t for ev in smol.generate(prompt, SamplingParams(max_tokens=20))
            if isinstance(ev, Tokens) for t in ev.token_ids]
    verdict = audit_answer(smol, prompt, greedy, free)
    assert verdict is not None and not verdict.ok and verdict.broke_constraint, verdict
    # A peer that kept the grammar but not the model: valid JSON, not the model's argmax.
    forged = smol._tokenize('{"name": "Zzyzx Qwertyuiop", "age": 117, "role": "chef"}', False)
    verdict = audit_answer(smol, prompt, greedy, forged)
    assert verdict is not None and not verdict.ok and not verdict.broke_constraint, verdict


@asynccontextmanager
async def llama_node() -> AsyncIterator[Node]:
    # 256 MiB: each request's stream then holds 512 tokens (the tool prompts run to ~300).
    engine = LlamaCppEngine(threads=1, capacity_bytes=256 << 20, extra_buffers=False)
    try:
        async with open_nodes(1, lambda i, bootstrap: Node(options(engine="llamacpp"), engine=engine)) as (node,):
            yield node
    finally:
        engine.close()


@pytest.mark.slow
async def test_tools_and_structured_output_through_the_openai_sdk() -> None:
    async with llama_node() as node:
        client = sdk(node).with_options(timeout=300)
        model = node.engine.model_name  # type: ignore[union-attr]
        question = _chat("What is the weather in Lyon?")
        for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 9}):
            answer = await in_thread(lambda extra=extra: client.chat.completions.create(
                model=model, messages=question, tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=False, max_tokens=80, **extra))
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            call = choice.message.tool_calls[0]
            spec = WEATHER if call.function.name == "get_weather" else TIME
            jsonschema.validate(json.loads(call.function.arguments),
                                spec["function"]["parameters"])  # type: ignore[index]
        # The round trip: the call, the tool's result, the final answer.
        history = [*question, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}]
        final = await in_thread(lambda: client.chat.completions.create(
            model=model, messages=history, tools=[WEATHER, TIME], tool_choice="none",
            temperature=0, max_tokens=16))
        assert final.choices[0].message.content and not final.choices[0].message.tool_calls
        # A JSON schema through response_format, with logprobs.
        done = await in_thread(lambda: client.chat.completions.create(
            model=model, messages=_chat("Describe a person as JSON."), max_tokens=80,
            temperature=0, logprobs=True, top_logprobs=3, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                       "strict": True}}))
        text = done.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
        content = done.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content and "".join(e.token for e in content) == text
        assert all(len(e.top_logprobs) == 3 for e in content)
