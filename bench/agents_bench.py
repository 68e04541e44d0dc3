"""Agents benchmark: structured outputs, tool calls, logprobs, audits and grammar overhead.

Run ``python bench/agents_bench.py`` (the default model, SmolLM2-135M-Instruct, on the CPU in
float32, one thread) for every section, or name some: ``masks schemas tools audit logprobs
overhead``. ``--json`` prints one JSON object at the end. ``--engine llamacpp`` runs the same
sections (but ``masks``, which compares libraries on the Hugging Face tokenizer) on the llama.cpp
engine (the default model's GGUF, one thread; logprobs against llama.cpp's own teacher-forced
logits). Each section prints its figures:

* ``masks``: per-token mask cost of the grammar libraries on the same schemas (llguidance, the
  one peerinfer uses; xgrammar and outlines-core when installed), replaying a valid JSON
  document token by token: mean and p99 microseconds per mask, and compile time per schema.
* ``schemas``: the suite of :data:`SCHEMAS` (nested objects, arrays, enums, required and
  optional fields, bounded numbers, string formats), each answered greedy and sampled (T=0.7)
  under its schema through the batch scheduler (8 at a time); the share of answers valid under
  their schema (``jsonschema`` with format checking), an answer cut by ``max_tokens`` counting
  as invalid.
* ``tools``: 50 questions with ``tool_choice: required`` (the grammar of
  ``peerinfer.engine.tools``), half greedy, half sampled: calls that parse and validate.
* ``audit``: every honest constrained answer above audited under its constraint (0 false
  failures expected), and the model's unconstrained answers to the same prompts audited under
  the constraint they ignore (each should be caught).
* ``logprobs``: the logprobs the engine reported for the schema answers against a
  teacher-forced float32 forward pass's log-softmax: the largest absolute difference.
* ``overhead``: decode steps with and without constraints, batch 1 and batch 8, in CPU time
  (``time.process_time``: the machine is shared; with one thread it is what the wall clock would
  read when idle). The grammar's cost per step is timed where it is spent (mask, its
  application, the state's advance) and given as a share of an unconstrained step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402

from peerinfer.core.messages import ChatMessage, Constraint, SamplingParams  # noqa: E402
from peerinfer.engine.base import Finished, Tokens  # noqa: E402

S = "string"
I = "integer"  # noqa: E741
N = "number"


def obj(props: dict[str, Any], required: Sequence[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else list(required),
            "additionalProperties": False, **extra}


def text(n: int = 30) -> dict[str, Any]:
    return {"type": S, "maxLength": n}


#: The schema suite: (name, schema, what to ask for).
SCHEMAS: list[tuple[str, dict[str, Any], str]] = [
    ("person", obj({"name": text(), "age": {"type": I, "minimum": 0, "maximum": 120}}), "a person"),
    ("city", obj({"name": text(), "country": text(), "population": {"type": I, "minimum": 0}}), "a city"),
    ("book", obj({"title": text(40), "author": text(), "year": {"type": I, "minimum": 1400, "maximum": 2030}}), "a book"),
    ("enum_color", obj({"color": {"enum": ["red", "green", "blue"]}}), "your favourite colour"),
    ("bool_flag", obj({"answer": {"type": "boolean"}, "reason": text(40)}), "whether the sky is blue"),
    ("bounded_float", obj({"temperature": {"type": N, "minimum": -50, "maximum": 60}}), "today's temperature"),
    ("exclusive_bounds", obj({"score": {"type": N, "exclusiveMinimum": 0, "exclusiveMaximum": 10}}), "a score for a film"),
    ("int_list", obj({"primes": {"type": "array", "items": {"type": I, "minimum": 2, "maximum": 100}, "minItems": 2, "maxItems": 5}}), "a few prime numbers"),
    ("string_list", obj({"fruits": {"type": "array", "items": text(15), "minItems": 1, "maxItems": 4}}), "some fruits"),
    ("enum_list", obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "maxItems": 3}}), "working days"),
    ("nested", obj({"user": obj({"name": text(), "address": obj({"street": text(), "city": text()})})}), "a user with an address"),
    ("nested_list", obj({"team": text(), "members": {"type": "array", "items": obj({"name": text(20), "role": {"enum": ["dev", "ops", "pm"]}}), "maxItems": 3}}), "a small team"),
    ("optional_fields", obj({"name": text(), "nickname": text(), "email": {"type": S, "format": "email"}}, required=["name"]), "a contact"),
    ("date", obj({"event": text(), "date": {"type": S, "format": "date"}}), "a historic event and its date"),
    ("email", obj({"email": {"type": S, "format": "email", "maxLength": 40}}), "an email address"),
    ("ipv4", obj({"host": text(20), "ip": {"type": S, "format": "ipv4"}}), "a server"),
    ("uuid", obj({"id": {"type": S, "format": "uuid"}}), "an identifier"),
    ("pattern", obj({"code": {"type": S, "pattern": "^[A-Z]{3}-[0-9]{3}$"}}), "a product code"),
    ("min_length", obj({"word": {"type": S, "minLength": 3, "maxLength": 10}}), "a word"),
    ("const", obj({"version": {"const": "1.0"}, "name": text()}), "a software release"),
    ("any_of", obj({"value": {"anyOf": [{"type": I}, {"type": S, "maxLength": 10}]}}), "a value"),
    ("one_of_objects", obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "radius": {"type": N, "minimum": 0, "maximum": 100}}), obj({"kind": {"const": "square"}, "side": {"type": N, "minimum": 0, "maximum": 100}})]}}), "a shape"),
    ("nullable", obj({"middle_name": {"type": [S, "null"], "maxLength": 20}, "last_name": text()}), "a name"),
    ("multiple_of", obj({"dozen": {"type": I, "multipleOf": 12, "minimum": 0, "maximum": 144}}), "a number of eggs"),
    ("tuple_items", obj({"point": {"type": "array", "prefixItems": [{"type": N}, {"type": N}], "items": False, "minItems": 2}}), "a point on a map"),
    ("ref_defs", {"$defs": {"item": obj({"name": text(20), "price": {"type": N, "minimum": 0, "maximum": 1000}})}, **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 3}})}, "a shopping list"),
    ("deep_nesting", obj({"a": obj({"b": obj({"c": obj({"d": {"type": I, "minimum": 0, "maximum": 9}})})})}), "a nested object"),
    ("recipe", obj({"title": text(), "servings": {"type": I, "minimum": 1, "maximum": 12}, "ingredients": {"type": "array", "items": text(20), "minItems": 1, "maxItems": 4}, "vegetarian": {"type": "boolean"}}), "a recipe"),
    ("weather", obj({"city": text(), "unit": {"enum": ["celsius", "fahrenheit"]}, "high": {"type": N, "minimum": -60, "maximum": 60}, "low": {"type": N, "minimum": -60, "maximum": 60}}), "a weather report"),
    ("order", obj({"order_id": {"type": I, "minimum": 1}, "status": {"enum": ["pending", "shipped", "delivered"]}, "items": {"type": "array", "items": obj({"sku": text(12), "qty": {"type": I, "minimum": 1, "maximum": 99}}), "minItems": 1, "maxItems": 3}}), "an order"),
    ("movie", obj({"title": text(), "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]}, "minItems": 1, "maxItems": 2}, "rating": {"type": N, "minimum": 0, "maximum": 10}}), "a movie"),
    ("json_object", {"type": "object"}, "any JSON object describing a cat"),
]

WEATHER = {"name": "get_weather", "description": "Current weather of a city", "parameters": obj(
    {"city": text(40), "unit": {"enum": ["celsius", "fahrenheit"]}})}
TIME = {"name": "get_time", "description": "Local time in a time zone", "parameters": obj(
    {"zone": {"type": S, "pattern": "^[A-Za-z]+/[A-Za-z_]+$", "maxLength": 40}})}
SEARCH = {"name": "search", "description": "Search the web", "parameters": obj(
    {"query": text(60), "max_results": {"type": I, "minimum": 1, "maximum": 10}}, required=["query"])}
TOOLS = [WEATHER, TIME, SEARCH]
QUESTIONS = [f"What is the weather in {c}?" for c in ("Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Rome", "Quito", "Perth")] + \
    [f"What time is it in {z}?" for z in ("Europe/Berlin", "America/New_York", "Asia/Tokyo", "Africa/Lagos")] + \
    [f"Search the web for {q}." for q in ("trio nurseries", "radix trees", "KV caches", "BLAKE2b", "llguidance")]

clock: Callable[[], float] = time.process_time


def load_engine(name: str = "hf") -> Any:
    if name == "llamacpp":
        from peerinfer.core.prefix import PrefixHasher
        from peerinfer.engine.llamacpp import LlamaCppEngine

        engine = LlamaCppEngine(threads=1, capacity_bytes=256 << 20)
        engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=16))
        return engine
    from peerinfer.engine.hf import TransformersEngine

    return TransformersEngine(device="cpu", dtype="float32", threads=1)


def reference_log_softmax(engine: Any, prompt: list[int], ids: list[int]) -> Any:
    """The engine's own teacher-forced log-softmax after each of ``ids``' predecessors
    (``[len(ids), vocab]``): float32 logits of a forward pass (Transformers), or llama.cpp's
    logits (``scored_logits``) log-softmaxed in float64."""
    import numpy as np

    if hasattr(engine, "scored_logits"):
        from peerinfer.engine.constraints import log_softmax_numpy

        logits = engine.scored_logits(prompt + ids, len(prompt))
        return np.stack([log_softmax_numpy(row) for row in logits])
    import torch

    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([prompt + ids])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1).numpy()


def schema_prompt(engine: Any, schema: dict[str, Any], what: str) -> list[int]:
    return engine.chat_prompt_tokens([
        ChatMessage("system", "You answer with JSON only, matching this JSON schema: "
                    + json.dumps(schema)),
        ChatMessage("user", f"Give me {what}."),
    ])


def run_batch(engine: Any, jobs: Sequence[tuple[Any, list[int], SamplingParams]],
              max_running: int = 8) -> dict[Any, dict[str, Any]]:
    """Run ``jobs`` (key, prompt, params) through the batch scheduler; per key: ids, text,
    logprobs, finish reason."""
    from peerinfer.engine.base import NEVER_CANCELLED
    from peerinfer.engine.batch import BatchScheduler

    scheduler = BatchScheduler(engine, max_running=max_running)
    out: dict[Any, dict[str, Any]] = {}
    for key, prompt, params in jobs:
        out[key] = {"ids": [], "text": "", "logprobs": [], "finish": None, "prompt": prompt,
                    "params": params}
        scheduler.submit(key, prompt, params, NEVER_CANCELLED)
    while not scheduler.idle:
        for key, event in scheduler.step():
            if isinstance(event, Tokens):
                out[key]["ids"].extend(event.token_ids)
                out[key]["text"] += event.text
                out[key]["logprobs"].extend(event.logprobs)
            elif isinstance(event, Finished):
                out[key]["finish"] = event.finish_reason
            elif isinstance(event, Exception):
                raise RuntimeError(f"{key}: {event}") from event
    scheduler.close()
    return out


# ----------------------------------------------------------------------------------- masks


def bench_masks(engine: Any, figures: dict[str, Any]) -> None:
    import numpy as np

    from peerinfer.engine.constraints import compile_grammar

    tok = engine.tokenizer
    vocab = engine.vocab_size
    documents = []
    for _name, schema, _ in SCHEMAS[:12]:
        instance = _example(schema)
        documents.append((schema, tok(json.dumps(instance), add_special_tokens=False)["input_ids"]))
    results: dict[str, Any] = {}

    # llguidance (through peerinfer's own wrapper: what the engine runs)
    grammar = engine.grammar_tokenizer()
    times: list[float] = []
    compile_s: list[float] = []
    for schema, ids in documents:
        t0 = time.perf_counter()
        state = grammar.matcher(Constraint("json_schema", json.dumps(schema)))
        state.allowed()
        compile_s.append(time.perf_counter() - t0)
        for t in ids:
            t0 = time.perf_counter()
            allowed = state.allowed()
            times.append(time.perf_counter() - t0)
            assert allowed[t], f"llguidance refuses token {t} of a valid document"
            state.advance(t)
    results["llguidance"] = _mask_figures(times, compile_s)
    _ = compile_grammar

    try:
        import xgrammar as xgr
    except ImportError:
        results["xgrammar"] = None
    else:
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        compiler = xgr.GrammarCompiler(info)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        times, compile_s = [], []
        for schema, ids in documents:
            t0 = time.perf_counter()
            matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
            matcher.fill_next_token_bitmask(bitmask)
            compile_s.append(time.perf_counter() - t0)
            for t in ids:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
                allowed = bits.astype(bool)
                times.append(time.perf_counter() - t0)
                if not allowed[t] or not matcher.accept_token(t):
                    break  # xgrammar's JSON layout differs from the document's: stop this one
        results["xgrammar"] = _mask_figures(times, compile_s)

    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        results["outlines_core"] = None
    else:
        eos = min(engine.eos_token_ids)
        pieces: dict[str, list[int]] = {}
        for token, i in tok.get_vocab().items():
            if i != eos and i < vocab:
                pieces.setdefault(tok.convert_tokens_to_string([token]), []).append(i)
        vocabulary = Vocabulary(eos, pieces)
        times, compile_s = [], []
        for schema, ids in documents[:4]:  # index building is slow: a few schemas only
            t0 = time.perf_counter()
            regex = build_regex_from_schema(json.dumps(schema), r"[ ]?")
            guide = Guide(Index(regex, vocabulary))
            compile_s.append(time.perf_counter() - t0)
            for t in ids:
                t0 = time.perf_counter()
                allowed_ids = guide.get_tokens()
                mask = np.zeros(vocab, dtype=bool)
                mask[allowed_ids] = True
                times.append(time.perf_counter() - t0)
                if not mask[t]:
                    break
                guide.advance(t)
        results["outlines_core"] = _mask_figures(times, compile_s)
    figures["masks"] = results
    for lib, r in results.items():
        if r is None:
            print(f"masks  {lib:14s} not installed")
        else:
            print(f"masks  {lib:14s} {r['mean_us']:8.1f} us/token mean, p99 {r['p99_us']:8.1f} us, "
                  f"{r['tokens']} tokens; compile {r['compile_ms_median']:.1f} ms median")


def _mask_figures(times: list[float], compile_s: list[float]) -> dict[str, Any]:
    ordered = sorted(times)
    return {
        "mean_us": 1e6 * statistics.fmean(times) if times else float("nan"),
        "p99_us": 1e6 * ordered[int(0.99 * (len(ordered) - 1))] if times else float("nan"),
        "tokens": len(times),
        "compile_ms_median": 1e3 * statistics.median(compile_s) if compile_s else float("nan"),
    }


def _example(schema: dict[str, Any]) -> Any:
    """A small valid instance of the simple schemas of the suite (for replaying masks)."""
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if kind == "object":
        return {k: _example(v) for k, v in schema.get("properties", {}).items()
                if k in schema.get("required", [])}
    if kind == "array":
        return [_example(schema["items"])] * max(1, schema.get("minItems", 1))
    if kind == I:
        return int(schema.get("minimum", 3))
    if kind == N:
        return float(schema.get("minimum", 1.5))
    if kind == "boolean":
        return True
    return "ab"


# --------------------------------------------------------------------- schemas and tools


def bench_schemas(engine: Any, figures: dict[str, Any], answers: list[dict[str, Any]]) -> None:
    checker = jsonschema.FormatChecker()
    jobs = []
    for mode, extra in (("greedy", {}), ("sampled", {"temperature": 0.7, "seed": 11})):
        for name, schema, what in SCHEMAS:
            kind = "json_object" if name == "json_object" else "json_schema"
            params = SamplingParams(max_tokens=200, constraint=Constraint(
                kind, "" if kind == "json_object" else json.dumps(schema)),
                logprobs=True, top_logprobs=5, **extra)
            jobs.append(((mode, name), schema_prompt(engine, schema, what), params))
    t0 = time.perf_counter()
    out = run_batch(engine, jobs)
    elapsed = time.perf_counter() - t0
    valid = {"greedy": 0, "sampled": 0}
    failures = []
    for (mode, name), r in out.items():
        schema = next(s for n, s, _ in SCHEMAS if n == name)
        try:
            # JSON numbers are decimals: 9.9999999999999999 is below an exclusive maximum
            # of 10 (a float parse would round it onto the bound; see performance.md).
            jsonschema.validate(json.loads(r["text"], parse_float=Decimal), schema,
                                format_checker=checker)
            ok = r["finish"] == "stop"
        except (ValueError, jsonschema.ValidationError) as exc:
            ok = False
            r["error"] = str(exc)[:120]
        valid[mode] += ok
        if not ok:
            failures.append({"schema": name, "mode": mode, "finish": r["finish"],
                             "text": r["text"][:200], "error": r.get("error", "")})
        answers.append({**r, "kind": "schema", "name": name})
    n = len(SCHEMAS)
    figures["schemas"] = {"count": n, "valid_greedy": valid["greedy"], "valid_sampled": valid["sampled"],
                          "failures": failures, "wall_s": elapsed,
                          "completion_tokens": sum(len(r["ids"]) for r in out.values())}
    print(f"schemas {n} schemas: valid greedy {valid['greedy']}/{n}, sampled {valid['sampled']}/{n} "
          f"({elapsed:.0f} s wall)")
    for f in failures:
        print("   invalid:", f)


def bench_tools(engine: Any, figures: dict[str, Any], answers: list[dict[str, Any]],
                parallel: bool = False) -> None:
    from peerinfer.engine.tools import parse_tool_calls, tool_call_grammar

    tools_json = json.dumps([{"type": "function", "function": f} for f in TOOLS])
    grammar = tool_call_grammar(TOOLS, parallel=parallel)
    jobs = []
    for i in range(50):
        question = QUESTIONS[i % len(QUESTIONS)]
        extra: dict[str, Any] = {} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
        params = SamplingParams(max_tokens=120, constraint=Constraint("lark", grammar), **extra)
        prompt = engine.chat_prompt_tokens([ChatMessage("user", question)], tools_json)
        jobs.append((i, prompt, params))
    out = run_batch(engine, jobs)
    good = 0
    failures = []
    schemas = {f["name"]: f["parameters"] for f in TOOLS}
    for i, r in out.items():
        parsed = parse_tool_calls(r["text"], list(schemas))
        ok = parsed is not None and r["finish"] == "stop"
        if parsed is not None:
            for call in parsed[1]:
                try:
                    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
                except jsonschema.ValidationError:
                    ok = False
        good += ok
        if not ok:
            failures.append({"i": i, "finish": r["finish"], "text": r["text"][:200]})
        answers.append({**r, "kind": "tool", "name": str(i)})
    figures["tools"] = {"requests": 50, "parallel_tool_calls": parallel,
                        "parsed_and_valid": good, "failures": failures}
    print(f"tools  tool_choice required (parallel_tool_calls {parallel}): {good}/50 calls "
          "parse and validate")
    for f in failures:
        print("   failed:", f)


# ---------------------------------------------------------------------- audit and logprobs


def bench_audit(engine: Any, figures: dict[str, Any], answers: list[dict[str, Any]]) -> None:
    from peerinfer.engine.audit import audit_answer

    honest = [a for a in answers if a["finish"] == "stop"][:100]
    false_failures = []
    t0 = time.perf_counter()
    for a in honest:
        verdict = audit_answer(engine, a["prompt"], a["params"], a["ids"])
        if verdict is None or not verdict.ok:
            false_failures.append({"name": a["name"], "kind": a["kind"],
                                   "why": verdict.describe() if verdict else "cannot audit"})
    audit_s = time.perf_counter() - t0
    # Peers that ignore the constraint: the model's free answer to the same prompt.
    liars = honest[:: max(1, len(honest) // 20)][:20]
    free = run_batch(engine, [(i, a["prompt"], SamplingParams(
        max_tokens=60, temperature=a["params"].temperature, seed=a["params"].seed))
        for i, a in enumerate(liars)])
    caught = 0
    for i, a in enumerate(liars):
        verdict = audit_answer(engine, a["prompt"], a["params"], free[i]["ids"])
        caught += verdict is not None and not verdict.ok
    figures["audit"] = {"honest": len(honest), "false_failures": len(false_failures),
                        "false_failure_details": false_failures, "liars": len(liars),
                        "caught": caught, "audit_s": audit_s}
    print(f"audit  {len(honest)} honest constrained answers: {len(false_failures)} false failures; "
          f"{caught}/{len(liars)} answers that ignore their constraint caught")
    for f in false_failures:
        print("   false failure:", f)


def bench_logprobs(engine: Any, figures: dict[str, Any], answers: list[dict[str, Any]]) -> None:
    worst = 0.0
    checked = 0
    for a in [a for a in answers if a["logprobs"]][:20]:
        ids = a["ids"]
        reference = reference_log_softmax(engine, a["prompt"], ids)
        entries = a["logprobs"]
        positions = [i for i, t in enumerate(ids) if t not in engine.eos_token_ids]
        for i, e in zip(positions, entries, strict=True):
            worst = max(worst, abs(e.logprob - float(reference[i, e.token_id])))
            for t in e.top:
                worst = max(worst, abs(t.logprob - float(reference[i, t.token_id])))
            checked += 1
    figures["logprobs"] = {"tokens": checked, "max_abs_diff": worst}
    print(f"logprobs {checked} tokens (top 5 each): max |engine - log_softmax| = {worst:.2e}")


# -------------------------------------------------------------------------------- overhead


def bench_overhead(engine: Any, figures: dict[str, Any]) -> None:
    """CPU time per decode step, unconstrained vs constrained, and the grammar's own time."""
    import peerinfer.engine.constraints as constraints

    spent = {"grammar": 0.0}

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["grammar"] += clock() - t0
        return wrapper

    original = (constraints.ConstraintState.allowed, constraints.ConstraintState.advance)
    llama = None
    if hasattr(engine, "scored_logits"):  # the llama.cpp engine masks with NumPy: time that too
        import peerinfer.engine.llamacpp_decoder as llama  # where guided_token reads the mask
    apply_mask = None if llama is None else llama.mask_logits_numpy
    schema = SCHEMAS[27][1]  # recipe: strings, numbers, arrays, enums
    results: dict[str, Any] = {}
    steps_wanted = 40
    for batch in (1, 8):
        row = {}
        for constrained in (False, True):
            prompts = [schema_prompt(engine, schema, f"recipe number {i}") for i in range(batch)]
            params = SamplingParams(max_tokens=steps_wanted + 1, constraint=Constraint(
                "json_schema", json.dumps(schema)) if constrained else None)
            from peerinfer.engine.base import NEVER_CANCELLED
            from peerinfer.engine.batch import BatchScheduler

            scheduler = BatchScheduler(engine, max_running=batch)
            for i, p in enumerate(prompts):
                scheduler.submit(i, p, params, NEVER_CANCELLED)
            # Prefill untimed: run until every request has its first token.
            started: set[int] = set()
            while len(started) < batch:
                for key, ev in scheduler.step():
                    if isinstance(ev, Tokens):
                        started.add(key)
            constraints.ConstraintState.allowed = timed(original[0])  # type: ignore[method-assign]
            constraints.ConstraintState.advance = timed(original[1])  # type: ignore[method-assign]
            if llama is not None:
                llama.mask_logits_numpy = timed(apply_mask)  # type: ignore[arg-type]
            spent["grammar"] = 0.0
            steps = 0
            t0 = clock()
            finished = 0
            while finished == 0 and steps < steps_wanted:
                events = scheduler.step()
                steps += 1
                finished = sum(isinstance(ev, Finished) for _, ev in events)
            elapsed = clock() - t0
            constraints.ConstraintState.allowed, constraints.ConstraintState.advance = original  # type: ignore[method-assign]
            if llama is not None:
                llama.mask_logits_numpy = apply_mask
            scheduler.close()
            row["constrained" if constrained else "free"] = {
                "step_ms": 1e3 * elapsed / steps, "grammar_ms": 1e3 * spent["grammar"] / steps,
                "steps": steps}
        free, con = row["free"], row["constrained"]
        row["step_ratio"] = con["step_ms"] / free["step_ms"]
        row["grammar_share"] = con["grammar_ms"] / free["step_ms"]
        results[f"batch{batch}"] = row
        print(f"overhead batch {batch}: step {free['step_ms']:.1f} ms free, {con['step_ms']:.1f} ms "
              f"constrained ({100 * (row['step_ratio'] - 1):+.1f} %); grammar (mask + advance) "
              f"{con['grammar_ms']:.2f} ms/step = {100 * row['grammar_share']:.1f} % of a free step "
              f"({con['steps']} steps)")
    figures["overhead"] = results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sections = ["masks", "schemas", "tools", "audit", "logprobs", "overhead"]
    parser.add_argument("sections", nargs="*", choices=[*sections, []], default=sections)
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--parallel-tools", action="store_true",
                        help="tools: allow several calls per answer (parallel_tool_calls)")
    parser.add_argument("--engine", choices=["hf", "llamacpp"], default="hf",
                        help="hf: the default model in float32; llamacpp: its GGUF (Q4), 1 thread")
    args = parser.parse_args(argv)
    wanted = args.sections or sections
    if args.engine == "llamacpp" and "masks" in wanted:
        if args.sections:
            parser.error("the masks section compares libraries on the Hugging Face tokenizer: "
                         "run it with --engine hf")
        wanted = [s for s in wanted if s != "masks"]
    engine = load_engine(args.engine)
    figures: dict[str, Any] = {"engine": args.engine, "schema_count": len(SCHEMAS)}
    answers: list[dict[str, Any]] = []
    if "masks" in wanted:
        bench_masks(engine, figures)
    if {"schemas", "audit", "logprobs"} & set(wanted):
        bench_schemas(engine, figures, answers)
    if {"tools", "audit"} & set(wanted):
        bench_tools(engine, figures, answers, args.parallel_tools)
    if "audit" in wanted:
        bench_audit(engine, figures, answers)
    if "logprobs" in wanted:
        bench_logprobs(engine, figures, answers)
    if "overhead" in wanted:
        bench_overhead(engine, figures)
    if args.json:
        print(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
