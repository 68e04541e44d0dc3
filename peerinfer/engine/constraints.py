"""Constrained decoding and logprobs: what every engine's sampler shares, row by row.

Theory of operation
-------------------
A request may carry a :class:`~peerinfer.core.messages.Constraint` (a JSON schema, any JSON
object, a Lark grammar or a regex) in its ``SamplingParams``. It is compiled by **llguidance**
(why that library: docs/architecture.md, "Constrained decoding") into a matcher over the
engine's own vocabulary, one per request, so every row of a batch has its own state:

* :func:`compile_grammar` turns a ``Constraint`` into llguidance's grammar text and
  :func:`check_constraint` validates it without any tokenizer (the HTTP API answers 400 with
  the library's message);
* :class:`GrammarTokenizer` is the engine's vocabulary as llguidance sees it (built once per
  engine: ``Engine.grammar_tokenizer()``);
* :class:`TokenGuide` is one request's per-step helper, created by ``RequestJob.start`` and
  handed to the backend in ``DecodeRequest.guide``. Before sampling a row the backend asks
  ``guide.allowed()`` (a boolean numpy array over the vocabulary, or None when the request is
  unconstrained) and masks the disallowed logits to -inf (:func:`mask_logits_numpy` for numpy
  logits; the Transformers engine does the same with torch); when logprobs are wanted it hands
  the row's raw logits to ``guide.note_logits(logits, token)`` after sampling.
  ``RequestJob.accept(token)`` then advances the state (``guide.advance``), refusing a token
  the constraint forbids (a backend that ignored the mask is a bug, not a user error), and
  puts the noted logprobs into the ``Tokens`` event.

The end: when the grammar is complete the mask allows only the end-of-sequence tokens (and
whatever would continue the grammar), so a constrained answer ends with the model's own EOS.
A grammar that can continue forever (``"a"*``) still ends at ``max_tokens``, like any request.

Logprobs are the model's raw log-softmax (before temperature, top-p and the mask), the
distribution the model gives; ``top`` lists the most likely tokens, most likely first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from peerinfer.core.messages import Constraint, TokenLogprob, TopLogprob
from peerinfer.errors import EngineError, InvalidRequestError

#: Texts of logprob entries are cut to this many characters (the wire's limit).
_MAX_TOKEN_TEXT = 256


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - fill_next_token_bitmask
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise InvalidRequestError(
            "constrained decoding needs the 'llguidance' package (pip install llguidance)"
        ) from exc
    return llguidance


#: How generated JSON is laid out: one line, OpenAI's separators. Flexible whitespace lets a
#: small model pad an answer with newlines until ``max_tokens``; a schema may override this
#: with its own ``x-guidance`` options.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compile_grammar(constraint: Constraint) -> str:
    """llguidance's grammar text for ``constraint`` (InvalidRequestError if it cannot be read)."""
    llg = _llguidance()
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return str(llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT))
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema must be a JSON object")
        try:
            return str(llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid JSON schema: {exc}") from None
    if kind == "lark":
        return str(llg.LLMatcher.grammar_from_lark(spec))
    if kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(spec))
    raise InvalidRequestError(f"unknown constraint kind {kind!r}")


def check_constraint(constraint: Constraint) -> str:
    """The compiled grammar of ``constraint``, or InvalidRequestError naming what is wrong
    (an unsupported JSON-schema keyword, a malformed grammar). Needs no tokenizer."""
    grammar = compile_grammar(constraint)
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        what = "JSON schema" if constraint.kind.startswith("json") else f"{constraint.kind} grammar"
        raise InvalidRequestError(f"unsupported or invalid {what}: {error}")
    return grammar


class GrammarTokenizer:
    """An engine's vocabulary for llguidance, built once per engine (it takes about a second).

    Build it with :meth:`from_hf` (a fast Hugging Face tokenizer) or :meth:`from_llamacpp` (a
    llama.cpp vocab); ``vocab_size`` is the model's logits width (it may exceed the
    tokenizer's: the extra ids are never allowed).
    """

    def __init__(self, ll_tokenizer: Any, vocab_size: int) -> None:
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32

    @classmethod
    def from_hf(cls, tokenizer: Any, vocab_size: int,
                eos_token_ids: Collection[int] = ()) -> GrammarTokenizer:
        _llguidance()
        import llguidance.hf

        eos = sorted(eos_token_ids) or None
        return cls(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos),
                   vocab_size)

    @classmethod
    def from_llamacpp(cls, vocab: Any, vocab_size: int,
                      eos_token_ids: Collection[int] = ()) -> GrammarTokenizer:
        _llguidance()
        import llguidance.llamacpp

        eos = sorted(eos_token_ids) or None
        return cls(llguidance.llamacpp.lltokenizer_from_vocab(vocab, n_vocab=vocab_size,
                                                              eos_token=eos), vocab_size)

    def matcher(self, constraint: Constraint) -> ConstraintState:
        """A fresh state for ``constraint`` (InvalidRequestError if it does not compile)."""
        return ConstraintState(self, constraint)


class ConstraintState:
    """One request's position in its constraint: the mask of allowed next tokens, advanced by
    each accepted token."""

    def __init__(self, tokenizer: GrammarTokenizer, constraint: Constraint) -> None:
        llg = _llguidance()
        grammar = check_constraint(constraint)
        self._llg = llg
        self._tokenizer = tokenizer
        self._matcher = llg.LLMatcher(tokenizer.ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequestError(f"the constraint does not compile: {self._matcher.get_error()}")
        self._bitmask = np.zeros((1, tokenizer._words), dtype=np.int32)
        self._allowed: np.ndarray | None = None
        for token in constraint.consumed:
            self.advance(token)

    def allowed(self) -> np.ndarray:
        """A boolean array over the vocabulary: the tokens that may come next (cached per step)."""
        if self._allowed is None:
            self._llg.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
            bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
            self._allowed = bits[: self._tokenizer.vocab_size].astype(bool)
            if not self._allowed.any():
                raise EngineError(f"the constraint allows no token: {self._matcher.get_error()}")
        return self._allowed

    def allows(self, token: int) -> bool:
        allowed = self.allowed()
        return 0 <= token < len(allowed) and bool(allowed[token])

    def advance(self, token: int) -> bool:
        """Consume ``token``; False (and the state is broken) if the constraint forbids it."""
        self._allowed = None
        return bool(self._matcher.consume_token(token))

    @property
    def accepting(self) -> bool:
        """The output so far is complete under the constraint."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


def mask_logits_numpy(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``logits`` (1-D, numpy) with every disallowed token at -inf, in place."""
    n = min(len(logits), len(allowed))
    logits[:n][~allowed[:n]] = -np.inf
    logits[n:] = -np.inf
    return logits


def log_softmax_numpy(logits: np.ndarray) -> np.ndarray:
    """The log-softmax of 1-D ``logits`` in float64 (for engines whose logits are numpy)."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - math.log(float(np.exp(x).sum()))


class TokenGuide:
    """One request's sampling helper (see the module docstring): its constraint state, if any,
    and the logprobs the backend noted for the token it sampled last."""

    __slots__ = ("state", "logprobs", "top_logprobs", "_noted", "_detokenize")

    def __init__(self, state: ConstraintState | None, logprobs: bool, top_logprobs: int,
                 detokenize: Callable[[Sequence[int]], str]) -> None:
        self.state = state
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self._noted: tuple[int, float, tuple[tuple[int, float], ...]] | None = None
        self._detokenize = detokenize

    def allowed(self) -> np.ndarray | None:
        """The allowed next tokens (boolean over the vocabulary), or None: any token."""
        return None if self.state is None else self.state.allowed()

    def note(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> None:
        """The backend's logprobs for ``token`` (and the top alternatives), after sampling it."""
        self._noted = (token, float(logprob), tuple((int(t), float(lp)) for t, lp in top))

    def note_logits(self, logits: np.ndarray, token: int) -> None:
        """The same from a numpy row of raw logits (for numpy-based backends)."""
        lps = log_softmax_numpy(logits)
        k = self.top_logprobs
        top: list[tuple[int, float]] = []
        if k:
            idx = np.argpartition(-lps, k)[:k] if k < len(lps) else np.arange(len(lps))
            idx = idx[np.argsort(-lps[idx], kind="stable")]
            top = [(int(i), float(lps[i])) for i in idx]
        self.note(token, float(lps[token]), top)

    def advance(self, token: int) -> None:
        """The job accepted ``token``: move the constraint on (EngineError if it forbids it)."""
        if self.state is not None:
            if not self.state.allows(token):
                raise EngineError(f"the backend sampled token {token}, which the constraint forbids")
            self.state.advance(token)

    def take_logprob(self, token: int) -> TokenLogprob | None:
        """The logprob entry of ``token`` as noted by the backend (None if none was noted)."""
        noted, self._noted = self._noted, None
        if not self.logprobs:
            return None
        if noted is None or noted[0] != token:
            raise EngineError("the backend did not report the logprobs of the token it sampled")
        _, lp, top = noted
        text = self._text
        return TokenLogprob(token, text(token), _finite(lp),
                            tuple(TopLogprob(t, text(t), _finite(v)) for t, v in top))

    def _text(self, token: int) -> str:
        return self._detokenize([token])[:_MAX_TOKEN_TEXT]


def _finite(logprob: float) -> float:
    # The wire carries finite numbers only; a token of probability 0 in float32 gets the floor.
    return max(-1e9, min(0.0, logprob)) if math.isfinite(logprob) else -1e9


__all__ = [
    "ConstraintState",
    "GrammarTokenizer",
    "TokenGuide",
    "check_constraint",
    "compile_grammar",
    "log_softmax_numpy",
    "mask_logits_numpy",
]
