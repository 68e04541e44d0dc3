"""A complete peerinfer backend in a few dozen lines: a byte-level "echo" model.

It tokenizes text as UTF-8 bytes and answers by repeating the prompt back, one byte per step,
reading the prompt cyclically. Everything else (validation, max_tokens, stop sequences,
incremental UTF-8-safe text, cancellation, events) comes from :class:`peerinfer.engine.Engine`.
It has no prefix cache, so it reports ``cached_tokens=0`` and no cache changes.

Use it without installing anything::

    peerinfer node --engine examples/custom_backend.py:EchoEngine

or from Python: ``load_engine("examples/custom_backend.py:EchoEngine", delay_s=0.01)``. A
package registers it under a name with an entry point in its ``pyproject.toml``::

    [project.entry-points."peerinfer.engines"]
    echo = "my_package.echo:EchoEngine"
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from peerinfer.engine import DecodeRequest, Engine


class EchoEngine(Engine):
    """Repeats the prompt's bytes. Deterministic; ``delay_s`` fakes compute per token."""

    # The identity prefix hashes are seeded with: change it whenever the output would change.
    fingerprint = b"peerinfer-example-echo/1"
    vocab_size = 256

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, tokens: Sequence[int]) -> str:
        # Half a multi-byte character decodes to U+FFFD; the base class holds such text back.
        return bytes(tokens).decode("utf-8", errors="replace")

    def generate_tokens(self, request: DecodeRequest) -> Iterator[int]:
        prompt = request.tokens
        i = 0
        while not request.cancel.is_set():  # the base class checks too, between tokens
            if self.delay_s:
                time.sleep(self.delay_s)
            yield prompt[i % len(prompt)]
            i += 1
