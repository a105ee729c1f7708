"""The Engram compressed-token map: tokenizer ids -> ids of normalised surface forms.

Engram hashes n-grams of *compressed* token ids, so that tokens which differ only in case,
accents, Unicode compatibility form or surrounding whitespace (``"The"``, ``" the"``,
``"THE"``) share one id and therefore one set of n-gram buckets. The official reference
derives the map from the tokenizer once, at model construction, with fixed normalisation
rules; this module reproduces those rules so that a checkpoint we write carries the same map
the reference would compute, and stores it next to the weights as
``engram_token_map.json``.

Rules, per token id in ``0..vocab-1``:

1. ``text = decode([id])`` with special tokens kept.
2. A byte-level token that is only part of a UTF-8 character decodes to U+FFFD; decoding
   would merge all such tokens into one key, so the raw vocabulary string is used instead.
3. Otherwise the key is ``normalize(text)``; a text that normalises to nothing keeps its
   decoded form, so e.g. a lone combining accent is not merged with the empty string.
4. Compressed ids are handed out in order of first appearance of each key.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from tokenizers import Regex, normalizers

REPLACEMENT_CHAR = "\ufffd"
# A private-use code point stands in for "a token that is only whitespace" (already squeezed to
# one space) while Strip runs, then turns back into the space. Without it every whitespace-only
# token would normalise to "" and fall back to its own decoded text (" ", "\n", "  " all
# distinct); with it they share the key " ".
_SPACE_SENTINEL = "\ue000"


class TokenizerLike(Protocol):
    """The three methods of ``tokenizers.Tokenizer`` the map needs (tests pass stand-ins)."""

    def get_vocab_size(self, with_added_tokens: bool = True) -> int: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def id_to_token(self, id: int) -> str | None: ...


@dataclass(frozen=True)
class EngramTokenMap:
    """Contents of ``engram_token_map.json``."""

    token_map: tuple[int, ...]  # tokenizer id -> compressed id
    compressed_vocab_size: int
    pad_id: int  # the tokenizer id Engram pads n-gram windows with
    pad_compressed_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.token_map)


@lru_cache(maxsize=1)
def engram_normalizer() -> normalizers.Normalizer:
    """The reference's normaliser: compatibility-fold, drop accents, lowercase, squeeze whitespace."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def token_key(decoded: str, raw_token: str | None) -> str:
    """The normalised key of one token, given its decoded text and its vocabulary string."""
    if REPLACEMENT_CHAR in decoded:
        # Partial UTF-8 sequences all decode to U+FFFD; the raw string keeps them apart.
        return raw_token if raw_token is not None else decoded
    normalized = engram_normalizer().normalize_str(decoded)
    return normalized if normalized else decoded


def build_compressed_token_map(tokenizer: TokenizerLike) -> tuple[list[int], int]:
    """Map every tokenizer id to a compressed id; returns ``(lookup, number_of_distinct_keys)``."""
    key_to_id: dict[str, int] = {}
    lookup: list[int] = []
    for token_id in range(tokenizer.get_vocab_size()):
        decoded = tokenizer.decode([token_id], skip_special_tokens=False)
        key = token_key(decoded, tokenizer.id_to_token(token_id))
        lookup.append(key_to_id.setdefault(key, len(key_to_id)))
    return lookup, len(key_to_id)


def write_token_map(path: str | Path, lookup: list[int], compressed_vocab_size: int, pad_id: int) -> None:
    """Write ``engram_token_map.json`` in the reference's layout (one JSON line, same key order)."""
    if not 0 <= pad_id < len(lookup):
        raise ValueError(f"pad id {pad_id} outside the vocabulary of {len(lookup)} tokens")
    if lookup and not 0 <= min(lookup) <= max(lookup) < compressed_vocab_size:
        raise ValueError(f"token map values must lie in [0, {compressed_vocab_size})")
    document = {
        "vocab_size": len(lookup),
        "compressed_vocab_size": compressed_vocab_size,
        "engram_pad_id": pad_id,
        "engram_pad_compressed_id": lookup[pad_id],
        "token_map": list(lookup),
    }
    path = Path(path)
    # Written to a sibling temp file and renamed, so a reader never sees half a map.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(document))
        os.chmod(tmp_name, 0o644)  # mkstemp creates it private; a checkpoint file is world-readable
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def load_token_map(path: str | Path) -> EngramTokenMap:
    """Read and check ``engram_token_map.json``; errors name the file and the inconsistency."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        token_map = tuple(int(i) for i in raw["token_map"])
        compressed = int(raw["compressed_vocab_size"])
        pad_id = int(raw["engram_pad_id"])
        pad_compressed = int(raw["engram_pad_compressed_id"])
        vocab_size = int(raw.get("vocab_size", len(token_map)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a valid Engram token map ({exc})") from exc
    if vocab_size != len(token_map):
        raise ValueError(f"{path}: vocab_size {vocab_size} but token_map has {len(token_map)} entries")
    if token_map and not 0 <= min(token_map) <= max(token_map) < compressed:
        raise ValueError(f"{path}: token_map values must lie in [0, {compressed})")
    if not 0 <= pad_id < len(token_map) or token_map[pad_id] != pad_compressed:
        raise ValueError(f"{path}: engram_pad_compressed_id {pad_compressed} != token_map[{pad_id}]")
    return EngramTokenMap(token_map, compressed, pad_id, pad_compressed)
