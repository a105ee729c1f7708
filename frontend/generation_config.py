"""Default sampling parameters from the model's ``generation_config.json``, as vLLM reads them.

A model's authors often recommend sampling settings there (DeepSeek's: ``temperature``,
``top_p``). vLLM's ``--generation-config`` semantics:

* ``auto`` (the default): the model directory's ``generation_config.json``;
* ``vllm``: none (neutral defaults: temperature 1, top_p 1, ...);
* a directory: the ``generation_config.json`` in that directory.

Only ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``) are taken; other keys (``do_sample``, token ids) are not
sampling defaults. On the server a request's own value always wins and ``max_tokens`` is capped by
the default; offline, ``LLM.generate`` without sampling parameters uses them
(``LLM.get_default_sampling_params``), as in vLLM.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
MODES = ("auto", "vllm")
_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
         "max_new_tokens": int}
_RANGES = {"temperature": (0.0, math.inf), "top_p": (1e-9, 1.0), "top_k": (-1, 2**31 - 1), "min_p": (0.0, 1.0),
           "repetition_penalty": (1e-9, math.inf), "max_new_tokens": (1, 2**31 - 1)}


def load_sampling_defaults(model_dir: str | Path | None, generation_config: str = "auto") -> dict[str, float | int]:
    """The default sampling parameters (names as in SamplingParams; ``max_tokens`` for HF's
    ``max_new_tokens``); empty when there are none. A file that is not JSON, or a value of the
    wrong type or out of range, is a ValueError naming the file and the key."""
    if generation_config == "vllm":
        return {}
    directory = model_dir if generation_config == "auto" else generation_config
    if directory is None:
        return {}
    path = Path(directory) / FILE_NAME
    if not path.is_file():
        if generation_config not in MODES:
            raise ValueError(f"--generation-config {generation_config}: no {FILE_NAME} in that directory")
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults: dict[str, float | int] = {}
    for key, kind in _KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
            raise ValueError(f"{path}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        low, high = _RANGES[key]
        if not low <= value <= high:
            raise ValueError(f"{path}: {key} = {value!r} is out of range")
        defaults["max_tokens" if key == "max_new_tokens" else key] = kind(value)
    if defaults:
        log.info("default sampling parameters from %s: %s (a request's own values win; "
                 "generation_config 'vllm' ignores the file)", path, defaults)
    return defaults
