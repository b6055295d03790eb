"""The Host header check: a server bound to loopback answers only requests addressed to a loopback name, so
that a web page the user visits cannot reach it through DNS rebinding (a name of the page's own that resolves to
127.0.0.1 sends its own name as Host)."""
from __future__ import annotations

import ipaddress
import re
from typing import Iterable, Optional

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?|[0-9a-f:.]+")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, extra: Iterable[str] = ()) -> Optional[frozenset[str]]:
    """The Host names to accept (None: any). Bound to loopback: loopback names plus `extra`; elsewhere only `extra`
    restricts; '*' in `extra` accepts any."""
    extra = [h.strip().lower() for item in extra for h in item.split(",") if h.strip()]
    for h in extra:
        if h != "*" and not _NAME.fullmatch(h):
            from kvinfer.errors import ValidationError

            raise ValidationError("allowed_hosts", h, "is not a host name or address (give names such as "
                                                      "myhost.lan or 192.168.1.5, without scheme or port, or '*')")
    if "*" in extra:
        return None
    if not is_loopback(bind_host):
        return frozenset(extra) if extra else None
    return frozenset([*LOOPBACK_NAMES, *extra])


def host_name(header: str) -> str:
    """The name in a Host header, without its port ('[::1]:8000' -> '::1')."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheckMiddleware:
    """403 for a request whose Host header names a host outside the allowed set (loopback ones always pass
    the check's loopback form: 127.0.0.2 or sub.localhost are loopback too)."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app = app
        self.allowed = allowed
        self.any_loopback = "localhost" in allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            raw = dict(scope.get("headers", [])).get(b"host")
            if raw is not None:  # HTTP/1.0 clients may send none; a browser always sends one
                name = host_name(raw.decode("latin-1"))
                if name not in self.allowed and not (self.any_loopback and is_loopback(name)):
                    from kvinfer.server.protocol import APIError

                    resp = APIError(403, f"the Host header {name!r} is not allowed: this server answers only "
                                         f"loopback names (start it with --allowed-hosts {name} to accept it)",
                                    "invalid_request_error", None, "host_not_allowed").response()
                    return await resp(scope, receive, send)
        await self.app(scope, receive, send)
