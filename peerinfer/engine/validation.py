"""Request validation shared by every engine: sampling parameters and the prompt, each refused
with a clear ``InvalidRequestError`` (the engine keeps serving)."""

from __future__ import annotations

import math
import operator

from peerinfer.core.messages import MAX_TOP_LOGPROBS, SamplingParams
from peerinfer.errors import InvalidRequestError

#: Limits on sampling parameters (the wire schema's bounds; local callers get the same checks).
MAX_NEW_TOKENS = 65_536
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_SEED = 2**64 - 1


def validate_sampling_params(params: object) -> SamplingParams:
    """Return ``params`` if it is a sane SamplingParams, else raise InvalidRequestError."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling parameters must be a SamplingParams, got {type(params).__name__}"
        )
    mt = params.max_tokens
    if type(mt) is not int or not 1 <= mt <= MAX_NEW_TOKENS:
        raise InvalidRequestError(f"max_tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {mt!r}")
    t = params.temperature
    if isinstance(t, bool) or not isinstance(t, int | float) or not (
        math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE
    ):
        raise InvalidRequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {t!r}")
    p = params.top_p
    if isinstance(p, bool) or not isinstance(p, int | float) or not (
        math.isfinite(p) and MIN_TOP_P <= p <= 1.0
    ):
        raise InvalidRequestError(f"top_p must be a number in [{MIN_TOP_P}, 1], got {p!r}")
    s = params.seed
    if s is not None and (type(s) is not int or not 0 <= s <= MAX_SEED):
        raise InvalidRequestError(f"seed must be None or an integer in [0, 2**64), got {s!r}")
    stop = params.stop
    if not isinstance(stop, tuple | list) or len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"stop must be a list of at most {MAX_STOP_SEQUENCES} strings")
    for item in stop:
        if type(item) is not str or not 1 <= len(item) <= MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"each stop sequence must be a string of 1 to {MAX_STOP_CHARS} characters, "
                f"got {item!r}"
            )
    k = params.top_logprobs
    if type(k) is not int or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    if k and not params.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs")
    return params


def validate_prompt(tokens: object, vocab_size: int, max_context_tokens: int) -> tuple[int, ...]:
    """The prompt as a tuple of ints, or InvalidRequestError saying what is wrong with it."""
    if isinstance(tokens, str | bytes):
        raise InvalidRequestError("the prompt must be a sequence of token ids; tokenize text first")
    if type(tokens) is tuple and tokens and set(map(type, tokens)) == {int}:
        # The common case, checked in C: a tuple of plain ints (bools are not plain ints).
        return _check_prompt_range(tokens, vocab_size, max_context_tokens)
    try:
        raw = list(tokens)  # type: ignore[call-overload]
    except TypeError as exc:
        raise InvalidRequestError(
            f"the prompt must be a sequence of token ids, got {type(tokens).__name__}"
        ) from exc
    if not raw:
        raise InvalidRequestError("the prompt is empty")
    try:
        if any(isinstance(t, bool) for t in raw):
            raise TypeError("booleans are not token ids")
        prompt = tuple(map(operator.index, raw))
    except TypeError as exc:
        raise InvalidRequestError(f"token ids must be integers: {exc}") from exc
    return _check_prompt_range(prompt, vocab_size, max_context_tokens)


def _check_prompt_range(
    prompt: tuple[int, ...], vocab_size: int, max_context_tokens: int
) -> tuple[int, ...]:
    if len(prompt) >= max_context_tokens:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; the model's context holds {max_context_tokens}, "
            "and at least one must be left to generate"
        )
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequestError(
            f"token id {bad} is outside the model's vocabulary [0, {vocab_size})"
        )
    return prompt


__all__ = [
    "MAX_NEW_TOKENS",
    "MAX_SEED",
    "MAX_STOP_CHARS",
    "MAX_STOP_SEQUENCES",
    "MAX_TEMPERATURE",
    "MIN_TOP_P",
    "validate_prompt",
    "validate_sampling_params",
]
