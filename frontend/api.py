"""The HTTP routes. Handlers read the raw body and validate it themselves (so every error is a
400 in OpenAI's envelope, never FastAPI's 422), then hand over to completions.py / chat.py."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .chat import create_chat_completion, render_messages
from .completions import create_completion
from .errors import bad_request
from .metrics import CONTENT_TYPE
from .openai_types import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, to_json
from .serving import ServingContext, check_token_ids

log = logging.getLogger(__name__)


def _json(value) -> Response:
    return Response(to_json(value), media_type="application/json")


def build_router(ctx: ServingContext, created: int) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(ctx, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(ctx, raw)

    @router.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList([ModelCard(ctx.model_name, created, ctx.max_model_len, root=ctx.model_root)]))

    @router.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        req = TokenizeRequest.model_validate_json(await raw.body())
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages")
        if req.messages is not None:
            ids = render_messages(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = ctx.require_tokenizer("tokenize").encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})

    @router.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = DetokenizeRequest.model_validate_json(await raw.body())
        ctx.check_model(req.model)
        tokenizer = ctx.require_tokenizer("detokenize")
        if req.tokens:
            check_token_ids(req.tokens, ctx.vocab_size, "tokens")
        return _json({"prompt": tokenizer.decode(req.tokens)})

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
        try:
            healthy = await ctx.engine.check_health()
        except Exception:  # a health check must answer, whatever broke
            log.exception("health check failed")
            healthy = False
        return Response(status_code=200 if healthy else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return router
