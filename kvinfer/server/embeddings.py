"""OpenAI's `POST /v1/embeddings`: each input is an engine request that pools its prompt's final hidden states
(kvinfer.engine.pooling), batched with everything else the engine runs; it holds no KV blocks once answered."""
from __future__ import annotations

import base64
import struct
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from kvinfer.engine.pooling import POOLING, embed_params, finish, model_pooling
from kvinfer.server.protocol import APIError, _Body, _CONFIG
from kvinfer.server.replies import collect


class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model_config = _CONFIG
    model: Optional[str] = Field(None, description="must be the served model name (see GET /v1/models)")
    input: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="a text, texts, token ids, or lists of token ids")
    encoding_format: Optional[Literal["float", "base64"]] = "float"
    dimensions: Optional[int] = Field(None, ge=1, description="keep the first values, renormalised")
    user: Optional[str] = None


def _inputs(x) -> list:
    if isinstance(x, str):
        items = [x]
    elif not x:
        raise APIError(400, "input is empty; give a text, texts, token ids or lists of token ids", param="input")
    elif isinstance(x[0], int):
        items = [x]
    else:
        items = list(x)
    for i, item in enumerate(items):
        if len(item) == 0:
            raise APIError(400, f"input[{i}] is empty", param="input")
    return items


def _encode(vec: list[float], fmt: Optional[str]):
    if fmt == "base64":  # little-endian float32, as OpenAI's (the SDK decodes it so by default)
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


def settings(app: FastAPI, model: Optional[str]) -> tuple[str, bool]:
    """(pooling, normalize): `kvinfer serve --pooling/--normalize` (app.state), else the model's
    sentence-transformers files, else last and not normalised."""
    own_pooling, own_normalize = model_pooling(model)
    pooling = getattr(app.state, "embedding_pooling", None) or own_pooling or "last"
    normalize = getattr(app.state, "embedding_normalize", None)
    return pooling, own_normalize if normalize is None else normalize


async def embeddings(body: EmbeddingRequest, request: Request):
    srv = request.app.state.server
    srv.check_model(body.model)
    items = _inputs(body.input)
    if len(items) > srv.engine.capacity:
        raise APIError(400, f"{len(items)} inputs in one request; this server holds at most "
                            f"{srv.engine.capacity}", param="input")
    hidden = srv.engine.engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise APIError(400, f"dimensions={body.dimensions} is more than the model's {hidden}", param="dimensions")
    pooling, normalize = settings(request.app, srv.config.model)
    stream = await srv.admit(items, embed_params(pooling), "embd")
    finals = await collect(stream, request, srv.metrics)
    if finals is None:
        return Response(status_code=499)
    data, tokens = [], 0
    for i, rid in enumerate(stream.request_ids):
        out = finals[rid]
        tokens += len(out.prompt_token_ids)
        vec = finish(out.embedding, normalize, body.dimensions)
        data.append({"object": "embedding", "index": i, "embedding": _encode(vec, body.encoding_format)})
    return {"object": "list", "data": data, "model": srv.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def add_embeddings_api(app: FastAPI) -> None:
    from kvinfer.server.protocol import ErrorResponse

    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"],
                      responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)})


__all__ = ["POOLING", "EmbeddingRequest", "add_embeddings_api", "settings"]
