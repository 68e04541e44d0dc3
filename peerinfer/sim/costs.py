"""The simulator's named cost models (``--costs``, mix classes) and how a cost model is read."""

from __future__ import annotations

import json
from pathlib import Path

from peerinfer.core.costmodel import BATCHED_COSTS, DEFAULT_COSTS, LLAMACPP_COSTS, CostModel
from peerinfer.errors import ConfigError

#: Named cost models for ``--costs``. ``default`` is ``DEFAULT_COSTS`` (a small model on a CPU:
#: prefill dominates and is slow next to any network delay). ``gpu`` is a home GPU serving a
#: 7-8B model (about 6,700 prompt tokens/s, 45 generated tokens/s): prefill is cheap enough that
#: a few tens of milliseconds of network delay cost as much as a cache hit saves. ``batched``
#: is ``BATCHED_COSTS``: the small model on the CPU, calibrated with its decode step time by
#: batch size, served 8 at a time.
COST_PRESETS: dict[str, CostModel] = {
    "default": DEFAULT_COSTS,
    "batched": BATCHED_COSTS,
    "gpu": CostModel(
        prefill_s_per_token=0.00015,
        cached_s_per_token=0.000005,
        decode_s_per_token=0.022,
        overhead_s=0.015,
        slots=1,
    ),
    # Issue 25's mixed engines: SmolLM2-135M-Instruct on one CPU thread. ``llamacpp`` is the
    # llama.cpp engine as calibrated (``LLAMACPP_COSTS``: ``peerinfer calibrate --engine
    # llamacpp``, the shipped Q4_1 GGUF, batches of up to 8 with their measured step times).
    # ``transformers`` (float32: ~380 prompt tokens/s, 15.7 generated tokens/s, one at a time)
    # is still the probe's figures (/work/shared/probes/README.md); its per-request overhead and
    # cached-token cost are the default model's.
    "llamacpp": LLAMACPP_COSTS,
    "transformers": CostModel(
        prefill_s_per_token=1 / 380,
        cached_s_per_token=DEFAULT_COSTS.cached_s_per_token,
        decode_s_per_token=1 / 15.7,
        overhead_s=DEFAULT_COSTS.overhead_s,
        slots=1,
    ),
}


def load_costs(path: str | Path) -> CostModel:
    """A cost model from a preset name (``COST_PRESETS``) or a JSON file: ``peerinfer
    calibrate``'s output, or a bare CostModel dict.

    The figures may sit at the top level or under a ``"costs"`` / ``"cost_model"`` key.
    """
    if str(path) in COST_PRESETS:
        return COST_PRESETS[str(path)]
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the cost model {path}: {exc}") from exc
    if isinstance(data, dict):
        for key in ("costs", "cost_model"):
            if isinstance(data.get(key), dict):
                data = data[key]
                break
    if not isinstance(data, dict) or "prefill_s_per_token" not in data:
        raise ConfigError(f"{path} holds no cost model (no prefill_s_per_token)")
    return CostModel.from_dict(data)


__all__ = ["COST_PRESETS", "load_costs"]
