"""Checks made before a body is parsed (API key, body size) and the errors of bodies that cannot be parsed."""
from __future__ import annotations

import hmac
from typing import Optional

from fastapi import HTTPException

from kvinfer.server.protocol import APIError

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/kv/")


class GuardMiddleware:
    def __init__(self, app, api_key: Optional[str], max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.api_key is not None and path.startswith(PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                msg = "missing API key: send 'Authorization: Bearer <key>'" if not auth else "invalid API key"
                resp = APIError(401, msg, "invalid_request_error", None, "invalid_api_key").response()
                resp.headers["WWW-Authenticate"] = "Bearer"
                return await resp(scope, receive, send)
        limit = self.max_body_bytes
        too_large = APIError(413, f"the request body is larger than the limit of {limit} bytes",
                             "invalid_request_error", None, "request_too_large")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n > limit:
                return await too_large.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(too_large)
            return msg

        await self.app(scope, limited_receive, send)


class BodyTooLarge(HTTPException):
    # FastAPI re-raises HTTPException from body reading; any other exception there becomes a generic 400.
    def __init__(self, err: APIError):
        super().__init__(413, err.message)
        self.err = err


def body_parse_error(e: BaseException) -> Optional[APIError]:
    """What is wrong with a body FastAPI could not parse (it says only 'There was an error parsing the body')."""
    cause = e.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, f"the body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} at offset "
                             f"{cause.start} ({cause.reason}); JSON bodies must be UTF-8", code="invalid_encoding")
    if isinstance(cause, RecursionError):
        return APIError(400, "the body's JSON is nested too deeply (objects and arrays inside each other more "
                             "than ~1000 levels)", code="invalid_json")
    return None
