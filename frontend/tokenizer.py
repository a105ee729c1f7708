"""The checkpoint's tokenizer: ``tokenizer.json`` (Hugging Face ``tokenizers``) plus
``tokenizer_config.json`` (bos/eos, chat template); incremental detokenization is in detokenizer.py.

Large inputs are tokenized (and detokenized) off the event loop, in a small thread pool, through
``encode_batch``/``decode_batch``: unlike ``encode``/``decode``, those release the GIL while the
Rust code runs, so a 5 MB prompt no longer stalls every other stream and ``/health`` for seconds.
Small inputs stay inline: a thread hop costs more than tokenizing a few kilobytes.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from .detokenizer import IncrementalDetokenizer


class TokenizerError(ValueError):
    pass


OFF_LOOP_CHARS = 16_384  # texts at least this long are encoded in the pool
OFF_LOOP_TOKENS = 4_096  # token lists at least this long are decoded in the pool
# Two threads: large requests do not queue behind one another, and they leave cores to the rest.
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenizer")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<...>", ...} form
        return value.get("content")
    return value


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: each of the 256 bytes is written as one printable
    character (printable Latin-1 bytes as themselves, the rest shifted above U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json")
        self.model_dir = model_dir
        self.hf = HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self.hf.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.hf.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.chat_template: str | None = self.config.get("chat_template")
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.model_max_length = self.config.get("model_max_length")
        self._compiled_template = None
        added = self.hf.get_added_tokens_decoder()
        self._added_tokens = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._byte_alphabet = _byte_level_alphabet() if isinstance(self.hf.decoder, decoders.ByteLevel) else None
        self._token_bytes: dict[int, bytes] = {}
        self._token_strings: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def _encode_unlocked(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.hf.encode_batch([text], add_special_tokens=False)[0].ids  # releases the GIL
        return [self.bos_token_id] + ids if add_special_tokens and self.add_bos else ids

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` that never blocks the event loop for long (large texts go to the pool)."""
        if len(text) < OFF_LOOP_CHARS:
            return self.encode(text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(_pool, self._encode_unlocked, text,
                                                                 add_special_tokens)

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``decode`` that never blocks the event loop for long (long token lists go to the pool)."""
        if len(ids) < OFF_LOOP_TOKENS:
            return self.decode(ids, skip_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            _pool, lambda: self.hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0])

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    # ------------------------------------------------------------------ one token, for logprobs
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level token may hold part of a character)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._compute_token_bytes(token_id)
        return cached

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_tokens:
            return self._added_tokens[token_id].encode()
        piece = self.hf.id_to_token(token_id)
        if piece is not None and self._byte_alphabet is not None and all(c in self._byte_alphabet for c in piece):
            return bytes(self._byte_alphabet[c] for c in piece)
        return self.hf.decode([token_id], skip_special_tokens=False).encode()

    def is_special(self, token_id: int) -> bool:
        """Added tokens that ``decode(skip_special_tokens=True)`` leaves out (bos, eos, role markers)."""
        return token_id in self._special_ids

    def token_string(self, token_id: int) -> str:
        """A token as text for logprobs; bytes that are not whole UTF-8 characters are written
        ``bytes:\\xNN...`` (as vLLM does) so distinct tokens never collapse into one U+FFFD key."""
        cached = self._token_strings.get(token_id)
        if cached is None:
            raw = self.token_bytes(token_id)
            try:
                cached = raw.decode("utf-8")
            except UnicodeDecodeError:
                cached = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_strings[token_id] = cached
        return cached

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs) -> str:
        """The template's text for ``messages``; ``template_kwargs`` are more template variables
        (chat_prompt.py keeps them from replacing these)."""
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template")
        template = self._template()
        return template.render(**template_kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=tools, bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def _template(self):
        """The chat template, compiled once (compiling costs milliseconds, rendering microseconds)."""
        if self._compiled_template is None:
            from jinja2 import StrictUndefined
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise TokenizerError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
            env.globals["raise_exception"] = raise_exception
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """An incremental detokenizer for the output that follows ``prompt_ids`` (detokenizer.py)."""
        return IncrementalDetokenizer(self, prompt_ids or (), skip_special_tokens)
