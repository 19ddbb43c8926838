"""vLLM's `POST /tokenize` and `POST /detokenize`, through the tokenizer service and a detokenizer.

`/tokenize`: `{model?, prompt | messages, add_special_tokens?, add_generation_prompt?}` →
`{count, max_model_len, tokens}`. A prompt gets the tokenizer's special tokens (bos) unless
`add_special_tokens` is false; messages are rendered with the model's chat template, ending with the
assistant turn's opening unless `add_generation_prompt` is false (`add_special_tokens` applies to a
prompt only). `/detokenize`: `{model?, tokens}` → `{prompt}`, special tokens kept. Other keys are
refused (400 naming them); so are token ids outside the vocabulary (400, the detokenizer's words).
"""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse

from gateway import params
from gateway.events import GenerateInput, tokenizer_failure
from gateway.openai_api import OpenAIHandlers, read_json
from gateway.openai_protocol import ApiError, decode_error, failure_error, requested_model
from gateway.params import ParamError
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.stages import TokenizeOptions

TOKENIZE_KEYS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}


def tokenize_request(body: dict[str, Any]) -> tuple[GenerateInput, TokenizeOptions]:
    """The input and tokenizer options of a `/tokenize` body. Raises ParamError."""
    params.only_keys(body, TOKENIZE_KEYS, "the request")
    special = params.boolean(body, "add_special_tokens")
    generation_prompt = params.boolean(body, "add_generation_prompt")
    prompt, messages = params.prompt_or_messages(body)
    if prompt is not None:
        if generation_prompt is not None:
            raise ParamError("add_generation_prompt", "'add_generation_prompt' applies to 'messages' only")
        return GenerateInput(prompt=prompt), TokenizeOptions(add_special_tokens=special)
    if special:
        raise ParamError("add_special_tokens", "'add_special_tokens' applies to 'prompt' only")
    return GenerateInput(messages=messages), TokenizeOptions(add_generation_prompt=generation_prompt)


class TokenizeHandlers:
    """`/tokenize` and `/detokenize`; routes are added by `http_app`."""

    def __init__(self, pipeline: Pipeline, settings: GatewaySettings, openai: OpenAIHandlers) -> None:
        self._pipeline = pipeline
        self._settings = settings
        self._openai = openai

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await read_json(request, self._settings.max_body_bytes)
        try:
            inp, options = tokenize_request(body)
            model = requested_model(body)
        except ParamError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        await self._openai.model_name(model)
        max_model_len = await self._openai.max_model_len()
        try:
            ids = await self._pipeline.tokenize(inp, options)
        except grpc.aio.AioRpcError as exc:
            raise failure_error(tokenizer_failure(exc), self._settings) from None
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> JSONResponse:
        body = await read_json(request, self._settings.max_body_bytes)
        try:
            params.only_keys(body, {"model", "tokens"}, "the request")
            ids = params.token_ids(body.get("tokens"), "tokens")
            model = requested_model(body)
        except ParamError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
        await self._openai.model_name(model)
        try:
            text = await self._pipeline.decode(list(ids), skip_special_tokens=False)
        except grpc.aio.AioRpcError as exc:
            raise decode_error(exc) from None
        return JSONResponse({"prompt": text})
