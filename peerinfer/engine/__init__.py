"""Inference engines: the backend interface, the Transformers and simulated backends.

Importing this package never imports torch: ``peerinfer.engine.hf`` is loaded only when the
``hf`` engine is chosen (``load_engine("hf")``) or imported explicitly.
"""

from peerinfer.engine.base import (
    NEVER_CANCELLED,
    CacheChanges,
    CachedPrefix,
    CancelToken,
    Decoder,
    DecodeRequest,
    Engine,
    EngineEvent,
    EngineStatistics,
    Finished,
    FinishReason,
    KVSegment,
    RequestJob,
    Started,
    TextStream,
    Tokens,
)
from peerinfer.engine.batch import BatchScheduler, SchedulerStatistics
from peerinfer.engine.registry import available_engines, load_engine, resolve_engine_class
from peerinfer.engine.simulated import Plan, SimulatedEngine

__all__ = [
    "NEVER_CANCELLED",
    "BatchScheduler",
    "CacheChanges",
    "CachedPrefix",
    "CancelToken",
    "DecodeRequest",
    "Decoder",
    "Engine",
    "EngineEvent",
    "EngineStatistics",
    "FinishReason",
    "Finished",
    "KVSegment",
    "Plan",
    "RequestJob",
    "SchedulerStatistics",
    "SimulatedEngine",
    "Started",
    "TextStream",
    "Tokens",
    "available_engines",
    "load_engine",
    "resolve_engine_class",
]
