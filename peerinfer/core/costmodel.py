"""The cost model: how long a node takes to serve a request, from token counts and batch size.

Used by the ``cost`` routing policy (to estimate a candidate's time to first token), by the
simulated engine (to decide how long to sleep) and by the simulator (virtual service times), so
that all three agree. ``peerinfer calibrate`` measures the figures on a real model; the defaults
below are such a measurement (see ``DEFAULT_COSTS``'s note).

The batched serving model
-------------------------
A node runs up to ``slots`` requests at once, the way the engine's batch scheduler does: every
scheduling step runs at most one prefill chunk (``prefill_chunk_tokens`` prompt tokens of the
oldest request still in prefill), then one decode step that gives every request past its
prefill one more token. So:

* A **decode step** with ``n`` requests decoding takes ``decode_step_s(n)``: interpolated
  piecewise-linearly in the measured points ``decode_step_s_by_batch`` (beyond the last point,
  the last segment's slope continues; below the first, the first point's time). Without points
  (a cost model written before batching) every step takes ``decode_s_per_token``: ideal
  batching, where running requests do not slow each other, as the single-slot model assumed.
* A **prefill chunk** of ``u`` uncached tokens takes ``u * prefill_s_per_token`` on an idle
  engine and ``u * prefill_busy_s_per_token`` while requests decode (the two forward passes of
  a step compete for the same caches); the request's first chunk also pays ``overhead_s`` and
  its cached tokens. Interleaved with ``n`` decoders, each of the request's chunks also waits
  one decode step of the others: ``prefill_s(prompt, cached, decoders=n)`` adds
  ``ceil(u / prefill_chunk_tokens) * decode_step_s(n)``.
* The **first token** is ready when the prefill ends (it is sampled from the prefill's
  logits); every further token takes one decode step of the batch it runs in.

With one slot, no request ever shares a step, and every figure is the single-request model's:
``prefill_s(p, c) + (g - 1) * decode_step_s(1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from peerinfer.errors import ConfigError

#: Batch sizes whose decode step times are precomputed (the routing hot path reads them).
_STEP_MEMO = 65


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-token costs in seconds and the number of requests a node serves at once.

    ``prefill_s_per_token``: one prompt token that is not in the cache, on an idle engine.
    ``cached_s_per_token``: one prompt token taken from the cache (rebuilding the model's cache
    from stored segments and attending over it is cheap, not free).
    ``decode_s_per_token``: one generated token of a request decoding alone.
    ``overhead_s``: fixed cost per request (tokenizing, scheduling, the first sampling step).
    ``slots``: how many requests run concurrently (the engine's ``max_batch_size``); more wait
    in the queue.
    ``decode_step_s_by_batch``: measured ``(running requests, seconds per decode step)`` points,
    batch sizes strictly increasing (empty: every step takes ``decode_s_per_token``).
    ``prefill_busy_s_per_token``: one uncached prompt token prefilled while other requests
    decode (None: the same as ``prefill_s_per_token``).
    ``prefill_chunk_tokens``: prompt tokens per prefill chunk (one chunk per scheduling step).
    """

    prefill_s_per_token: float = 0.00296
    cached_s_per_token: float = 0.000055
    decode_s_per_token: float = 0.0759
    overhead_s: float = 0.0474
    slots: int = 1
    decode_step_s_by_batch: tuple[tuple[int, float], ...] = ()
    prefill_busy_s_per_token: float | None = None
    prefill_chunk_tokens: int = 512
    #: decode_step_s(n) for n < _STEP_MEMO, filled in by __post_init__ (not a parameter)
    _steps: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "cached_s_per_token", "decode_s_per_token", "overhead_s"):
            v = getattr(self, name)
            if not (v >= 0.0 and v < 1e6):
                raise ConfigError(f"cost model: {name} must be a non-negative number, got {v!r}")
        busy = self.prefill_busy_s_per_token
        if busy is not None and not (busy >= 0.0 and busy < 1e6):
            raise ConfigError(
                f"cost model: prefill_busy_s_per_token must be a non-negative number, got {busy!r}"
            )
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ConfigError(f"cost model: slots must be an integer >= 1, got {self.slots!r}")
        if (
            isinstance(self.prefill_chunk_tokens, bool)
            or not isinstance(self.prefill_chunk_tokens, int)
            or self.prefill_chunk_tokens < 1
        ):
            raise ConfigError(
                f"cost model: prefill_chunk_tokens must be an integer >= 1, "
                f"got {self.prefill_chunk_tokens!r}"
            )
        points = _check_points(self.decode_step_s_by_batch)
        object.__setattr__(self, "decode_step_s_by_batch", points)
        object.__setattr__(
            self, "_steps", tuple(self._interpolate(n) for n in range(_STEP_MEMO))
        )

    # ------------------------------------------------------------ the batched model

    def _interpolate(self, running: int) -> float:
        points = self.decode_step_s_by_batch
        if not points:
            return self.decode_s_per_token if running > 0 else 0.0
        if running <= 0:
            return 0.0
        if running <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if running <= n1:
                return t0 + (t1 - t0) * (running - n0) / (n1 - n0)
        if len(points) == 1:
            return points[0][1]
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return max(0.0, t1 + (t1 - t0) * (running - n1) / (n1 - n0))

    def decode_step_s(self, running: int) -> float:
        """One decode step with ``running`` requests decoding (0 for none)."""
        if 0 <= running < _STEP_MEMO:
            return self._steps[running]
        return self._interpolate(running)

    @property
    def prefill_busy_rate(self) -> float:
        """Seconds per uncached prompt token prefilled while others decode."""
        busy = self.prefill_busy_s_per_token
        return self.prefill_s_per_token if busy is None else busy

    def prefill_chunks(self, uncached_tokens: int) -> int:
        """Scheduling steps a prefill of ``uncached_tokens`` takes (at least one)."""
        return max(1, -(-uncached_tokens // self.prefill_chunk_tokens))

    def prefill_s(self, prompt_tokens: int, cached_tokens: int, decoders: int = 0) -> float:
        """Time to first token once the request runs, with ``decoders`` other requests
        decoding meanwhile: overhead, prefill of the rest (each chunk also waiting one decode
        step of the others)."""
        # (``min(cached_tokens, prompt_tokens)`` without the builtin's call: the routes ask this
        # about a dozen times per request)
        cached = prompt_tokens if prompt_tokens < cached_tokens else cached_tokens
        uncached = prompt_tokens - cached
        if decoders <= 0:
            return self.overhead_s + uncached * self.prefill_s_per_token + cached * self.cached_s_per_token
        return (
            self.overhead_s
            + uncached * self.prefill_busy_rate
            + cached * self.cached_s_per_token
            + self.prefill_chunks(uncached) * self.decode_step_s(decoders)
        )

    def decode_s(self, generated_tokens: int, running: int = 1) -> float:
        """Time for the tokens after the first, decoding in a batch of ``running``."""
        return max(0, generated_tokens - 1) * self.decode_step_s(max(1, running))

    def service_s(
        self, prompt_tokens: int, cached_tokens: int, generated_tokens: int, running: int = 1
    ) -> float:
        """A whole request on a node that keeps ``running`` requests (this one included)
        running throughout: its prefill next to ``running - 1`` decoders, then its decode."""
        return self.prefill_s(prompt_tokens, cached_tokens, running - 1) + self.decode_s(
            generated_tokens, running
        )

    def queue_wait_s(self, outstanding: int, slots: int, service_s: float) -> float:
        """Expected wait for a slot with ``outstanding`` requests queued or running on
        ``slots``: none below ``slots``; else ``outstanding - slots + 1`` must finish first, the
        oldest half done, a full batch finishing one every ``service_s / slots``."""
        if outstanding < slots:
            return 0.0
        return (outstanding - slots + 0.5) * service_s / slots

    def prefill_backlog_s(
        self, ahead: int, prompt_tokens: int, cached_tokens: int, generated_tokens: int
    ) -> float:
        """Expected prefill work of ``ahead`` running requests that comes before a joiner's
        own prefill (prefill runs one chunk at a time, oldest first, so a joiner waits for the
        prefills under way even when a slot is free). Each of them, shaped like the joiner, is
        in its prefill with probability ``phi = P / (P + D)``, its share of its time in a batch
        of ``ahead + 1`` (``P`` its prefill next to ``ahead`` decoders, ``D`` its decode); of
        the ``k = ahead * phi`` expected in prefill, the one under way is half done."""
        if ahead <= 0:
            return 0.0
        p = self.prefill_s(prompt_tokens, cached_tokens, ahead)
        d = self.decode_s(generated_tokens, ahead + 1)
        if not p + d > 0.0:
            return 0.0
        k = ahead * p / (p + d)
        return p * (k - 0.5) if k >= 1.0 else p * k / 2

    def full_service_s(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int,
                       slots: int) -> float:
        """Service time of a request on a node whose ``slots`` are all busy (the rate at which
        a saturated node frees a slot is ``slots`` per this time)."""
        return self.service_s(prompt_tokens, cached_tokens, generated_tokens, max(1, slots))

    def estimate_ttft_s(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        generated_tokens: int,
        outstanding: int,
        slots: int,
        service_s: float | None = None,
    ) -> tuple[float, float]:
        """``(ttft_s, wait_s)`` of a new request on a node with ``outstanding`` requests
        queued or running on ``slots``: it waits for a slot only if the batch is full, then
        for the prefills under way (``prefill_backlog_s`` of requests shaped like it), then
        prefills next to the others decoding. ``service_s`` (default: this request's service
        at a full batch) is the mean service time of the slot wait. ``wait_s`` is both waits."""
        slots = max(1, slots)
        if service_s is None:
            service_s = self.full_service_s(prompt_tokens, cached_tokens, generated_tokens, slots)
        decoders = min(outstanding, slots - 1)
        wait = self.queue_wait_s(outstanding, slots, service_s) + self.prefill_backlog_s(
            decoders, prompt_tokens, cached_tokens, generated_tokens
        )
        return wait + self.prefill_s(prompt_tokens, cached_tokens, decoders), wait

    def with_slots(self, slots: int) -> CostModel:
        return replace(self, slots=slots)

    # ------------------------------------------------------------ announced speed

    def speed(self) -> tuple[int, int, int, int]:
        """What a node announces of its speed (``Load.speed``): nanoseconds per uncached
        prompt token, per cached prompt token, per generated token (decoding alone) and per
        request."""
        return (
            round(self.prefill_s_per_token * 1e9),
            round(self.cached_s_per_token * 1e9),
            round(self.decode_s_per_token * 1e9),
            round(self.overhead_s * 1e9),
        )

    def at_speed(self, speed: tuple[int, ...]) -> CostModel:
        """This model for a machine that announced ``speed`` (four figures, as ``speed()``):
        those four figures, and the batch's shape scaled from this model's (each decode step
        time by the ratio of the per-token decode costs, the busy prefill rate by that of
        the prefill costs), for want of the peer's own measurements."""
        if len(speed) != 4:
            raise ConfigError(f"cost model: a speed has 4 figures, got {len(speed)}")
        prefill, cached, decode, overhead = (x / 1e9 for x in speed)
        own_decode, own_prefill = self.decode_s_per_token, self.prefill_s_per_token
        decode_ratio = decode / own_decode if own_decode > 0 else 1.0
        prefill_ratio = prefill / own_prefill if own_prefill > 0 else 1.0
        busy = self.prefill_busy_s_per_token
        return replace(
            self,
            prefill_s_per_token=prefill,
            cached_s_per_token=cached,
            decode_s_per_token=decode,
            overhead_s=overhead,
            decode_step_s_by_batch=tuple(
                (n, t * decode_ratio) for n, t in self.decode_step_s_by_batch
            ),
            prefill_busy_s_per_token=None if busy is None else busy * prefill_ratio,
        )

    # ------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, object]:
        return {
            "prefill_s_per_token": self.prefill_s_per_token,
            "cached_s_per_token": self.cached_s_per_token,
            "decode_s_per_token": self.decode_s_per_token,
            "overhead_s": self.overhead_s,
            "slots": self.slots,
            "decode_step_s_by_batch": [[n, t] for n, t in self.decode_step_s_by_batch],
            "prefill_busy_s_per_token": self.prefill_busy_s_per_token,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> CostModel:
        """The model a ``to_dict`` (or an older one, without the batch fields) describes."""
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and not k.startswith("_")}
        points = known.get("decode_step_s_by_batch")
        if points is not None:
            if isinstance(points, dict):  # {"1": 0.07, "8": 0.12}: calibrate's measurement form
                points = sorted(points.items(), key=lambda kv: int(kv[0]))
            if not isinstance(points, (list, tuple)):
                raise ConfigError("cost model: decode_step_s_by_batch must be a list of pairs")
            try:
                known["decode_step_s_by_batch"] = tuple(
                    (int(n), float(t)) for n, t in points
                )
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"cost model: decode_step_s_by_batch: {exc}") from exc
        try:
            return cls(**known)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(f"cost model: {exc}") from exc


def _check_points(points: object) -> tuple[tuple[int, float], ...]:
    if not isinstance(points, (tuple, list)):
        raise ConfigError("cost model: decode_step_s_by_batch must be a sequence of pairs")
    out: list[tuple[int, float]] = []
    for point in points:
        if not isinstance(point, (tuple, list)) or len(point) != 2:
            raise ConfigError(f"cost model: decode step point {point!r} is not a pair")
        n, t = point
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"cost model: decode step batch size must be >= 1, got {n!r}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 <= t < 1e6):
            raise ConfigError(f"cost model: decode step time must be non-negative, got {t!r}")
        if out and n <= out[-1][0]:
            raise ConfigError("cost model: decode step batch sizes must strictly increase")
        out.append((n, float(t)))
    return tuple(out)


#: SmolLM2-135M-Instruct (float32, CPU, one torch thread) as measured by ``peerinfer calibrate
#: --clock cpu`` on the 2-core development machine (docs/performance.md), one request at a time
#: (``slots`` 1, no batch table: the model every figure before batching used).
#: A GPU or more threads are faster: run ``peerinfer calibrate`` on your machine and pass
#: ``--costs`` to the node.
DEFAULT_COSTS = CostModel()

#: The same model and machine served in batches of up to 8: one run of ``peerinfer calibrate
#: --threads 1 --device cpu --clock cpu --statistic min`` (docs/performance.md, where its output
#: is), per-request figures and batch measurements together. The decode step times at 1, 2, 4,
#: 8 and 16 running requests (512-token contexts) were measured by forward passes of the model
#: over a batch sharing one KV cache, before the engine had its own batched decode; the busy
#: prefill rate is the fitted rate times the ratio (1.018) of 512-token chunks timed next to 8
#: decoders and alone. ``slots`` is 8, the batching engine's default ``max_batch_size`` when it was
#: measured; a node announces its engine's own (``default_costs``: 16 for today's default).
BATCHED_COSTS = CostModel(
    prefill_s_per_token=0.002401,
    cached_s_per_token=0.0000613,
    decode_s_per_token=0.05911,
    overhead_s=0.07543,
    slots=8,
    decode_step_s_by_batch=((1, 0.07138), (2, 0.09101), (4, 0.13334), (8, 0.23071), (16, 0.28907)),
    prefill_busy_s_per_token=0.002444,
    prefill_chunk_tokens=512,
)


#: SmolLM2-135M-Instruct's shipped Q4_1 GGUF on the llama.cpp engine, CPU, one thread (a portable
#: AVX2 build on the 2-core AMD EPYC Zen 2 development machine), served up to 8 at a time: one run
#: of ``peerinfer calibrate --engine llamacpp --threads 1 --clock cpu --statistic min`` (Dec 6,
#: load 4-10; docs/performance.md, "Calibration (peerinfer calibrate --engine llamacpp)"). The
#: decode steps were measured by the engine's own ``decode_batch`` at 1, 2, 4 and 8 running
#: (512-token contexts; its 10 sequences hold no 16): an 8-row step costs 6.3 one-row steps,
#: because ggml has no batched Q4_1 kernel on AVX2. The prefill line's intercept came out below
#: zero, so ``overhead_s`` is 0 as fitted. A CPU node on this engine announces it when
#: ``--costs`` gives none (``LlamaCppEngine.default_costs``); the simulator's ``llamacpp``
#: preset is this model. ``prefill_chunk_tokens`` is not measured: it is the engine's chunk,
#: 128 since Dec 6 (512 when calibrated; with 32-token ubatches the per-token rate is the same).
LLAMACPP_COSTS = CostModel(
    prefill_s_per_token=0.009842,
    cached_s_per_token=0.0002314,
    decode_s_per_token=0.01426,
    overhead_s=0.0,
    slots=8,
    decode_step_s_by_batch=((1, 0.02068), (2, 0.04054), (4, 0.06808), (8, 0.12951)),
    prefill_busy_s_per_token=0.009387,
    prefill_chunk_tokens=128,  # the engine's chunk (engine/llamacpp.py DEFAULT_PREFILL_CHUNK)
)


def default_costs(slots: int) -> CostModel:
    """The default cost model of a node whose engine runs ``slots`` requests at once:
    ``DEFAULT_COSTS`` for one, ``BATCHED_COSTS`` with that capacity for more."""
    return DEFAULT_COSTS if slots <= 1 else BATCHED_COSTS.with_slots(slots)


__all__ = ["BATCHED_COSTS", "DEFAULT_COSTS", "LLAMACPP_COSTS", "CostModel", "default_costs"]
