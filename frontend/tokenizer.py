"""The checkpoint's tokenizer: ``tokenizer.json`` (Hugging Face ``tokenizers``) plus
``tokenizer_config.json`` (bos/eos, chat template), with incremental detokenization."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    pass


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<...>", ...} form
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json")
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template")
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TokenizerError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def detokenizer(self, prompt_ids: list[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)


@dataclass
class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted as deltas that never split a character.

    Byte-level tokens can end in the middle of a UTF-8 character (decoded as U+FFFD); such text
    is held back until the following tokens complete it.
    """

    tokenizer: Tokenizer
    token_ids: list[int] = None  # type: ignore[assignment]
    emitted: str = ""

    def __post_init__(self) -> None:
        self.token_ids = []

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text."""
        self.token_ids.extend(new_ids)
        text = self.tokenizer.decode(self.token_ids)
        stable = text.rstrip("\ufffd") if text.endswith("\ufffd") else text
        if not stable.startswith(self.emitted):
            # a later token changed earlier text (rare merges): re-sync without emitting twice
            common = 0
            while common < min(len(stable), len(self.emitted)) and stable[common] == self.emitted[common]:
                common += 1
            stable = self.emitted + stable[common:] if len(stable) > len(self.emitted) else self.emitted
        delta = stable[len(self.emitted):]
        self.emitted += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        text = self.tokenizer.decode(self.token_ids)
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta
