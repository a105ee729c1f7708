"""The expert-load statistics file (``--eplb-stats-file``): routed tokens per MoE layer and logical
expert, kept between runs so that a new start can place the experts by their load.

A JSON document (small: layers x experts integers, readable, diffable)::

    {"format": "mini-deepinfer-expert-load", "version": 1,
     "num_layers": 43, "num_experts": 256,
     "tokens": [[...256 integers...], ...43 rows...]}

``tokens[l][e]``: how many times a token was routed to logical expert ``e`` of layer ``l`` (one
count per (token, expert) pair: a token counts once for each of its top-k experts), summed over
every DP rank. The engine core writes it (at shutdown and every few minutes, atomically:
a temporary file renamed over the old one); every worker reads it at startup.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

FORMAT = "mini-deepinfer-expert-load"
VERSION = 1


class ExpertLoadFileError(ValueError):
    """The statistics file cannot be used for this model."""


@dataclass(frozen=True)
class ExpertLoadCounts:
    """Routed tokens per layer and logical expert: ``tokens[layer][expert]``."""

    tokens: tuple[tuple[int, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.tokens)

    @property
    def num_experts(self) -> int:
        return len(self.tokens[0]) if self.tokens else 0

    @property
    def total(self) -> int:
        return sum(sum(row) for row in self.tokens)

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> "ExpertLoadCounts":
        return cls(((0,) * num_experts,) * num_layers)

    def __add__(self, other: "ExpertLoadCounts") -> "ExpertLoadCounts":
        if (self.num_layers, self.num_experts) != (other.num_layers, other.num_experts):
            raise ExpertLoadFileError(f"cannot add expert loads of {other.num_layers} x {other.num_experts} to "
                                      f"{self.num_layers} x {self.num_experts}")
        return ExpertLoadCounts(tuple(tuple(a + b for a, b in zip(x, y)) for x, y in zip(self.tokens, other.tokens)))


def read_expert_load(path: str | Path, num_layers: int, num_experts: int) -> ExpertLoadCounts | None:
    """The counts of ``path`` (None if it does not exist yet), checked against the model's sizes."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExpertLoadFileError(f"{path}: not a readable expert-load file ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ExpertLoadFileError(f"{path}: not an expert-load file (no \"format\": \"{FORMAT}\")")
    if document.get("version") != VERSION:
        raise ExpertLoadFileError(f"{path}: expert-load file version {document.get('version')!r}, this engine "
                                  f"reads version {VERSION}")
    tokens = document.get("tokens")
    if (document.get("num_layers"), document.get("num_experts")) != (num_layers, num_experts):
        raise ExpertLoadFileError(f"{path}: recorded for {document.get('num_layers')} MoE layers of "
                                  f"{document.get('num_experts')} experts; this model has {num_layers} of "
                                  f"{num_experts} (delete the file, or give another --eplb-stats-file)")
    if (not isinstance(tokens, list) or len(tokens) != num_layers
            or any(not isinstance(row, list) or len(row) != num_experts for row in tokens)
            or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for row in tokens for v in row)):
        raise ExpertLoadFileError(f"{path}: \"tokens\" must be {num_layers} rows of {num_experts} counts >= 0")
    return ExpertLoadCounts(tuple(tuple(row) for row in tokens))


def write_expert_load(path: str | Path, counts: ExpertLoadCounts) -> None:
    """Write ``counts`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    document = {"format": FORMAT, "version": VERSION, "num_layers": counts.num_layers,
                "num_experts": counts.num_experts, "tokens": [list(row) for row in counts.tokens]}
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in document.items() if k != "tokens")
    text += ',\n "tokens": [\n' + ",\n".join("  " + json.dumps(row) for row in document["tokens"]) + "\n ]}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
