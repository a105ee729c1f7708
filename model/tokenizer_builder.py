"""Train the byte-level BPE tokenizer that ships with generated checkpoints.

A generated checkpoint must be served end to end (chat template, stop on eos, detokenize), so it
gets a real tokenizer instead of a stand-in: byte-level BPE, like DeepSeek's own, trained on the
small original corpus in ``model/data/corpus.txt``, to exactly the preset's vocabulary size. The
corpus yields about 2.2k tokens; a preset with the real vocabulary (129280) gets the rest as
reserved filler tokens ``<|reserved_N|>`` after the learned ones, so token ids, embedding rows and
the Engram token map have the real model's sizes. Training is deterministic (same corpus and
size -> byte-identical ``tokenizer.json``), which keeps the default model's cache key meaningful
and tests reproducible.

Special tokens take the first ids, in this order: bos 0, eos 1, pad 2, ``<｜User｜>`` 3,
``<｜Assistant｜>`` 4. As in DeepSeek's tokenizer, encoding with special tokens prepends bos;
the chat template writes bos itself, so a rendered chat prompt is encoded with
``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜pad｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]

DEFAULT_CORPUS = Path(__file__).parent / "data" / "corpus.txt"
RESERVED_TOKEN = "<|reserved_{}|>"

# DeepSeek-style chat format: bos, then each turn; system text verbatim, user turns after
# <｜User｜>, assistant turns after <｜Assistant｜> and closed by eos; a generation prompt is
# an open <｜Assistant｜>. Whitespace control (``-``) keeps template layout out of the prompt.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- message['content'] -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '" + USER_TOKEN + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT_TOKEN + "' + (message['content'] or '') + eos_token -}}"
    "{%- else -%}"
    "{{- raise_exception('unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + ASSISTANT_TOKEN + "' -}}"
    "{%- endif -%}"
)


def _paragraphs(text: str) -> Iterator[str]:
    """Blank-line separated chunks, newlines kept, so merges of indentation and line breaks are learned."""
    chunk: list[str] = []
    for line in text.splitlines(keepends=True):
        chunk.append(line)
        if not line.strip():
            yield "".join(chunk)
            chunk = []
    if chunk:
        yield "".join(chunk)


def train_tokenizer(vocab_size: int = 1024, corpus_path: str | Path = DEFAULT_CORPUS) -> Tokenizer:
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` tokens (specials included).

    BPE learns merges as far as the corpus allows; when that falls short of ``vocab_size`` the
    remaining ids are reserved filler tokens (see ``_add_reserved_tokens``).
    """
    text = Path(corpus_path).read_text(encoding="utf-8")
    # Byte-level BPE never needs an unknown token: every byte is in the initial alphabet.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_paragraphs(text), trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        _add_reserved_tokens(tokenizer, vocab_size - tokenizer.get_vocab_size())
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"made a {tokenizer.get_vocab_size()}-token tokenizer, {vocab_size} requested")
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _add_reserved_tokens(tokenizer: Tokenizer, count: int) -> None:
    """Append ``count`` tokens ``<|reserved_0|>``, ``<|reserved_1|>``, ... after the learned vocabulary.

    They are added tokens (matched verbatim in input text) but not special: a randomly initialised
    model samples them most of the time, and a special token would vanish from the decoded output
    (``skip_special_tokens``), leaving empty completions instead of visible text.
    """
    tokenizer.add_tokens([AddedToken(RESERVED_TOKEN.format(i), special=False, normalized=False)
                          for i in range(count)])


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` Hugging Face tooling and our frontend read next to tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out_dir = Path(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config = tokenizer_config(model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
