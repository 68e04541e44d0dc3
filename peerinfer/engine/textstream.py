"""Incremental detokenization: generated token ids to text chunks that never change once
released (multi-byte characters and stop sequences held back until settled)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """Turns generated token ids into text chunks that never change once released.

    Decoding a window of recent tokens (after vLLM/TGI): text is released when the decoded
    window grew and does not end in U+FFFD (the replacement character a partial multi-byte
    character decodes to). The window starts with a few prompt tokens so that tokenizers that
    drop a leading space at the start of a sequence still produce it. Text that could be the
    beginning of a stop sequence is held back; when a stop sequence appears, the text before it
    is released and the stream reports that it stopped.
    """

    CONTEXT_TOKENS = 4

    def __init__(
        self,
        detokenize: Callable[[Sequence[int]], str],
        prompt: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:
        self._detokenize = detokenize
        self._ids: list[int] = list(prompt[-self.CONTEXT_TOKENS :])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that became stable (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        ids = self._ids
        before = self._detokenize(ids[self._prefix : self._read])
        after = self._detokenize(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
            return self._release(delta)
        return ""

    def finish(self) -> str:
        """The text still held (unstable tail, stop-sequence candidates) at the end."""
        if self.stopped:
            return ""
        ids = self._ids
        before = self._detokenize(ids[self._prefix : self._read])
        after = self._detokenize(ids[self._prefix :])
        tail = after[len(before) :] if len(after) > len(before) else ""
        self._prefix = self._read = len(ids)
        out = self._release(tail)
        if not self.stopped:
            out, self._held = out + self._held, ""
        return out

    def _release(self, delta: str) -> str:
        text = self._held + delta
        if not self._stop:
            self._held = ""
            return text
        cut = -1
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


__all__ = ["TextStream"]
