"""The HTTP routes. Handlers read the raw body and validate it themselves (so every error is a
400 in OpenAI's envelope, never FastAPI's 422), then hand over to completions.py / chat.py.

POST bodies must be sent as ``application/json`` (415 otherwise): a web page can send
``text/plain`` to any local server without a CORS preflight, and must not be able to drive this
one. The body's size is bounded while it is read (server.py's ``BodyLimitMiddleware``)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .errors import APIError
from .health import HealthProbe

from .chat import create_chat_completion, render_messages
from .completions import create_completion
from .errors import bad_request
from .metrics import CONTENT_TYPE
from .openai_types import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, to_json
from .serving import ServingContext, check_token_ids

log = logging.getLogger(__name__)


def _json(value) -> Response:
    return Response(to_json(value), media_type="application/json")


async def json_body(raw: Request) -> bytes:
    media_type = raw.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                       "invalid_request_error", None, "unsupported_media_type")
    return await raw.body()


def build_router(ctx: ServingContext, created: int, model_names: tuple[str, ...] = ()) -> APIRouter:
    """``model_names``: every name /v1/models lists (``--served-model-name`` with several; default the
    context's one)."""
    router = APIRouter()
    names = model_names or (ctx.model_name,)
    probe = HealthProbe(ctx.engine)

    @router.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(ctx, raw, await json_body(raw))

    @router.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(ctx, raw, await json_body(raw))

    @router.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList([ModelCard(name, created, ctx.max_model_len, root=names[0]) for name in names]))

    @router.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        # a text prompt is bounded by the body limit only (counting the tokens of a text too long
        # for the context is a legitimate use); it is tokenized off the event loop
        req = TokenizeRequest.model_validate_json(await json_body(raw))
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages")
        if req.messages is not None:
            ids = await render_messages(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = await ctx.require_tokenizer("tokenize").encode_async(req.prompt, req.add_special_tokens)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})

    @router.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = DetokenizeRequest.model_validate_json(await json_body(raw))
        ctx.check_model(req.model)
        tokenizer = ctx.require_tokenizer("detokenize")
        if req.tokens:
            check_token_ids(req.tokens, ctx.vocab_size, "tokens")
        return _json({"prompt": await tokenizer.decode_async(req.tokens)})

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        tokenizer = ctx.require_tokenizer("tokenizer_info")
        return _json({
            "tokenizer_class": tokenizer.config.get("tokenizer_class"),
            "vocab_size": tokenizer.vocab_size,
            "model_vocab_size": ctx.vocab_size,
            "bos_token": tokenizer.bos_token, "bos_token_id": tokenizer.bos_token_id,
            "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_token_id,
            "add_bos_token": tokenizer.add_bos,
            "chat_template": tokenizer.chat_template,
            "max_model_len": ctx.max_model_len,
        })

    @router.get("/health")
    async def health() -> Response:
        """Cheap and answered within a second (health.py); 503 while draining or unhealthy."""
        if ctx.admission.draining:
            return Response(b'{"status":"draining"}', status_code=503, media_type="application/json")
        if await probe.healthy():
            return Response(b'{"status":"ok"}', media_type="application/json")
        return Response(b'{"status":"unhealthy"}', status_code=503, media_type="application/json")

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return router
