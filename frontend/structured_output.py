"""Structured output on the API side: the request's constraint as one ``StructuredOutput``, checked
before it reaches the engine.

Accepted forms (at most one per request; two or more are a 400 naming them):

* OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* vLLM's ``guided_json`` (a schema object or its JSON text), ``guided_regex``, ``guided_choice`` (a
  list of strings), ``guided_grammar`` (EBNF/GBNF), and their newer spelling ``structured_outputs``
  (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``).

Every schema, regex and grammar is compiled here with xgrammar against the model's tokenizer (one
``GrammarCompiler`` per server, with its cache), in a small thread pool and under a deadline, so a
bad one gets a 400 naming the problem and a pathological one never blocks the event loop. JSON
schemas are also checked for keywords that xgrammar accepts but would not enforce (``not``,
``if``/``then``/``else``, ``allOf`` of several schemas, ``multipleOf`` on non-integers, unknown
``format``s, ``pattern`` with a length bound, ...): those get a 400, never a silently looser answer.
``oneOf`` is enforced as ``anyOf`` (exact for disjoint alternatives, the usual case).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine_core.protocol import StructuredOutput

from .errors import APIError, bad_request, overloaded

if TYPE_CHECKING:
    from .openai_types import SamplingRequest
    from .tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer to compile is refused (400)
COMPILE_THREADS = 2  # compiles at once (one past its deadline keeps its thread until it ends)
MAX_WAITING_COMPILES = 64  # requests waiting for a compile thread; beyond that, or waiting too long: 503
MAX_SCHEMA_DEPTH = 64  # nesting of subschemas
VALIDATION_CACHE_SIZE = 1024  # (kind, spec) -> verdict, so a repeated request costs no compile
COMPILER_CACHE_BYTES = 64 << 20

# JSON-schema string formats xgrammar enforces (others it would silently ignore)
SUPPORTED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference", "uri-template", "ipv4",
    "ipv6", "hostname", "json-pointer", "relative-json-pointer"})
# keywords xgrammar accepts but does not enforce
_UNSUPPORTED_KEYWORDS = {
    "not": "'not'", "if": "'if'/'then'/'else'", "then": "'if'/'then'/'else'", "else": "'if'/'then'/'else'",
    "contentEncoding": "'contentEncoding'", "contentMediaType": "'contentMediaType'",
    "contentSchema": "'contentSchema'"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")


# ----------------------------------------------------------------------------- request -> StructuredOutput
def _schema_from(value: Any, param: str) -> dict:
    """A JSON schema given as an object or as its JSON text: must be a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object, got {_json_type(value)}", param)
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _schema_spec(schema: dict, param: str) -> StructuredOutput:
    check_schema_features(schema, param)
    return StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))


def _choice_spec(choices: list[str], param: str) -> StructuredOutput:
    if not choices:
        raise bad_request(f"{param} must list at least one choice", param)
    if any(not c for c in choices):
        raise bad_request(f"{param} entries must be non-empty strings", param)
    return StructuredOutput("choice", json.dumps(list(choices), ensure_ascii=False))


def _text_spec(kind: str, text: str, param: str) -> StructuredOutput:
    if not text:
        raise bad_request(f"{param} must not be empty", param)
    return StructuredOutput(kind, text)


def structured_from_request(req: "SamplingRequest") -> StructuredOutput | None:
    """The request's constraint (None: unconstrained); 400 for a malformed one or for several."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise bad_request("response_format.json_schema is only allowed with type 'json_schema'",
                                  "response_format")
            found.append(("response_format", StructuredOutput("json_object")))
        else:
            param = "response_format.json_schema"
            if fmt.json_schema is None:
                raise bad_request(f"{param} is required when response_format.type is 'json_schema'", "response_format")
            if fmt.json_schema.schema_ is None:
                raise bad_request(f"{param}.schema is required", "response_format")
            schema = fmt.json_schema.schema_
            if not isinstance(schema, dict):
                raise bad_request(f"{param}.schema must be a JSON schema object, got {_json_type(schema)}",
                                  "response_format")
            found.append(("response_format", _schema_spec(schema, f"{param}.schema")))
    elif fmt is not None and fmt.json_schema is not None:
        raise bad_request("response_format.json_schema is only allowed with type 'json_schema'", "response_format")
    if req.guided_json is not None:
        found.append(("guided_json", _schema_spec(_schema_from(req.guided_json, "guided_json"), "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", _text_spec("regex", req.guided_regex, "guided_regex")))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice_spec(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", _text_spec("grammar", req.guided_grammar, "guided_grammar")))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            param = "structured_outputs.json"
            found.append((param, _schema_spec(_schema_from(so.json_, param), param)))
        if so.regex is not None:
            found.append(("structured_outputs.regex", _text_spec("regex", so.regex, "structured_outputs.regex")))
        if so.choice is not None:
            found.append(("structured_outputs.choice", _choice_spec(so.choice, "structured_outputs.choice")))
        if so.grammar is not None:
            found.append(("structured_outputs.grammar",
                          _text_spec("grammar", so.grammar, "structured_outputs.grammar")))
        if so.json_object:
            found.append(("structured_outputs.json_object", StructuredOutput("json_object")))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"at most one structured-output constraint per request; got {names}", found[1][0])
    return found[0][1] if found else None


# ----------------------------------------------------------------------------- JSON-schema features
def check_schema_features(schema: Any, param: str) -> None:
    """400 for a schema using what the grammar compiler would not enforce (see the module doc)."""
    _check_schema(schema, param, "#", 0)


def _unsupported(param: str, path: str, what: str) -> APIError:
    return bad_request(f"{param}: unsupported JSON schema feature at {path}: {what}", param.split(".")[0])


def _check_schema(schema: Any, param: str, path: str, depth: int) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: the schema at {path} must be an object or a boolean, got {_json_type(schema)}",
                          param.split(".")[0])
    if depth > MAX_SCHEMA_DEPTH:
        raise _unsupported(param, path, f"subschemas nested deeper than {MAX_SCHEMA_DEPTH}")
    for key, what in _UNSUPPORTED_KEYWORDS.items():
        if key in schema:
            raise _unsupported(param, path, f"{what} is not enforced by the grammar compiler")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise _unsupported(param, path, "'allOf' with more than one schema (merge them into one)")
    if "multipleOf" in schema:
        value = schema["multipleOf"]
        if schema.get("type") != "integer" or not isinstance(value, int) or isinstance(value, bool):
            raise _unsupported(param, path, "'multipleOf' is only enforced on type 'integer' with an integer value")
    fmt = schema.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        raise _unsupported(param, path, f"string format {fmt!r} (supported: {', '.join(sorted(SUPPORTED_FORMATS))})")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise _unsupported(param, path, "'pattern' together with 'minLength'/'maxLength' (put the length in the "
                                        "pattern)")
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                _check_schema(value, param, f"{path}/{key}/{name}", depth + 1)
    for key in _SCHEMA_VALUES:
        sub = schema.get(key)
        if isinstance(sub, (dict, bool)):
            _check_schema(sub, param, f"{path}/{key}", depth + 1)
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                _check_schema(value, param, f"{path}/{key}/{i}", depth + 1)


# ----------------------------------------------------------------------------- compiling (validation)
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:.]+\]\s+\S+:\d+:\s*")


def _compile_message(exc: BaseException) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    message = _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return message[:500]


_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice list"}


class GrammarValidator:
    """Compiles constraints with xgrammar exactly as the engine will, to refuse bad ones up front.

    The tokenizer info and compiler are built on first use (in the pool): servers that never see a
    structured request pay nothing."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, eos_token_id: int | None, *,
                 timeout_s: float = COMPILE_TIMEOUT_S, threads: int = COMPILE_THREADS):
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self.timeout_s, self.threads = timeout_s, threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None  # made in the event loop, at first use
        self._waiting = 0
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_id),
                                                     max_threads=2, cache_enabled=True,
                                                     cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler

    def _compile(self, kind: str, spec: str) -> str | None:
        """The compile error's message, or None when it compiles."""
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                compiler.compile_regex(spec)
            elif kind == "grammar":
                compiler.compile_grammar(spec)
            elif kind == "json_object":
                compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "choice":
                compiler.compile_grammar(choice_grammar(json.loads(spec)))
            else:
                return f"unknown structured-output kind {kind!r}"
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError/TypeError) for bad input
            return _compile_message(exc)
        return None

    async def _compile_bounded(self, structured: StructuredOutput, param: str) -> str | None:
        """Compile in the pool: at most ``threads`` at once (a compile past its deadline keeps its
        thread until it ends), a bounded number waiting for one; 503 when they are all taken."""
        if self._waiting >= MAX_WAITING_COMPILES:
            raise overloaded("too many structured-output constraints are waiting to be compiled; retry later")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.threads)
        self._waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise overloaded("every grammar compiler thread stayed busy (compiling other requests' "
                             "constraints); retry later") from None
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        slots = self._slots
        future = self._pool.submit(self._compile, structured.kind, structured.spec)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(slots.release))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise bad_request(f"the {_KIND_NAMES.get(structured.kind, structured.kind)} in {param} did not "
                              f"compile within {self.timeout_s:g} s; simplify it", param) from None

    async def validate(self, structured: StructuredOutput, param: str) -> None:
        key = (structured.kind, structured.spec)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        else:
            verdict = await self._compile_bounded(structured, param)
            self._verdicts[key] = verdict
            if len(self._verdicts) > VALIDATION_CACHE_SIZE:
                self._verdicts.popitem(last=False)
        if verdict is not None:
            raise bad_request(f"invalid {_KIND_NAMES.get(structured.kind, structured.kind)} in {param}: {verdict}",
                              param)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer: "Tokenizer", vocab_size: int, eos_token_id: int | None):
    """xgrammar's view of the model's vocabulary: the tokenizer's tokens by id (byte-level BPE or
    raw; special tokens as empty strings, which xgrammar never puts in a grammar's text), padded to
    the model's vocabulary size, with eos as the stop token."""
    import xgrammar as xgr
    from tokenizers import decoders

    encoded = [""] * tokenizer.vocab_size
    for piece, token_id in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        if 0 <= token_id < len(encoded):
            encoded[token_id] = "" if tokenizer.is_special(token_id) else piece
    vocab_type = xgr.VocabType.BYTE_LEVEL if isinstance(tokenizer.hf.decoder, decoders.ByteLevel) else xgr.VocabType.RAW
    stop = [eos_token_id] if eos_token_id is not None else None
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=max(vocab_size, len(encoded)), stop_token_ids=stop)


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- the entry point
def _param_of(req: "SamplingRequest") -> str:
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
        if getattr(req, name) is not None:
            return name
    return "response_format"


async def resolve_structured(req: "SamplingRequest", ctx) -> StructuredOutput | None:
    """The request's checked constraint for ``SamplingParams.structured`` (None: unconstrained)."""
    structured = structured_from_request(req)
    if structured is None:
        return None
    param = _param_of(req)
    if ctx.tokenizer is None:
        raise bad_request("structured output needs the model's tokenizer, and this model has none", param)
    validator = ctx.grammar_validator()
    if validator is None:
        raise bad_request("structured output is not available on this server (xgrammar is not installed)", param)
    await validator.validate(structured, param)
    return structured
