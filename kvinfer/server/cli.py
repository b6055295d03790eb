"""`kvinfer serve`: the OpenAI-compatible HTTP server on uvicorn (registered into the main CLI)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

DEFAULT_MAX_QUEUE = 256  # mirrors kvinfer.engine.async_engine; kept here so `--help` does not import torch
DEFAULT_MAX_BODY = "4MiB"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # mirrors kvinfer.server.lifecycle


def add_server_args(p: argparse.ArgumentParser) -> None:
    from kvinfer.cli import int_at_least

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int_at_least("--port", 0, 65535), default=8000,
                   help="TCP port (default 8000; 0 picks a free one)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /kv/state "
                        "(the web page asks for it)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the model file or directory name)")
    g.add_argument("--max-queue", type=int_at_least("--max-queue", 0), default=DEFAULT_MAX_QUEUE,
                   help=f"requests that may wait beyond --max-num-seqs running ones; more get 429 "
                        f"(default {DEFAULT_MAX_QUEUE})")
    g.add_argument("--max-request-bytes", "--max-body-bytes", dest="max_body_bytes", default=DEFAULT_MAX_BODY,
                   help=f"largest request body, e.g. 1048576 or 4MiB; larger gets 413 before it is parsed "
                        f"(default {DEFAULT_MAX_BODY})")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="HOST[,HOST]",
                   help="Host header names to answer besides localhost/127.0.0.1/::1 when bound to loopback (other "
                        "names get 403, against DNS rebinding); when bound elsewhere, the only names answered; "
                        "'*' answers any")
    g.add_argument("--responses-store-size", default=None, metavar="SIZE",
                   help="memory for responses kept by store: true on /v1/responses, e.g. 256MiB; every stored byte "
                        "counts and the oldest go first (default 1/32 of RAM, at most 1GiB)")
    g.add_argument("--quiet", action="store_true",
                   help="no access line per finished request and no periodic engine line on stderr")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long running requests may take to finish before they end with "
                        f"an error (default {DEFAULT_SHUTDOWN_TIMEOUT:g}); new requests get 503 meanwhile")
    g.add_argument("--pooling", choices=("last", "mean", "cls"), default=None,
                   help="how /v1/embeddings pools a text's final hidden states (default: the model's "
                        "sentence-transformers setting, else last)")
    g.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), default=None,
                   help="split a thinking model's <think>...</think> into reasoning_content (chat) and reasoning "
                        "items (responses)")
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise embeddings (default: the model's sentence-transformers setting, else no)")


def register(subparsers) -> None:
    from kvinfer.cli import add_engine_args

    s = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, responses, metrics)",
        description="Serve the model over HTTP: POST /v1/completions, /v1/chat/completions and /v1/responses "
                    "(OpenAI's; streaming with stream: true), /v1/messages (Anthropic's), /v1/embeddings, GET "
                    "/v1/models, /health, /metrics (Prometheus), POST /tokenize and /detokenize; a web page at / "
                    "(chat and the KV cache live).")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    add_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)


def bind_socket(host: str, port: int):
    """A listening-ready socket on host:port, or a one-line error naming what is wrong with them."""
    import socket

    from kvinfer.errors import ValidationError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValidationError("host", host, f"is not an address of this machine ({getattr(e, 'strerror', e)})") \
            from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart over TIME_WAIT
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValidationError("port", port, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def cmd_serve(args) -> int:
    from kvinfer.cli import engine_config_from_args
    from kvinfer.errors import ValidationError
    from kvinfer.utils import parse_size

    if args.max_queue < 0:
        raise ValidationError("max_queue", args.max_queue, "must be >= 0")
    if not args.shutdown_timeout >= 0:
        raise ValidationError("shutdown_timeout", args.shutdown_timeout, "must be >= 0 seconds")
    if not 0 <= args.port <= 65535:
        raise ValidationError("port", args.port, "must be in [0, 65535]")
    max_body = parse_size(args.max_body_bytes, "max_body_bytes")
    store_bytes = None if args.responses_store_size is None else parse_size(args.responses_store_size,
                                                                           "responses_store_size")
    from kvinfer.server.hosts import allowed_hosts_for

    allowed_hosts = allowed_hosts_for(args.host, args.allowed_hosts)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValidationError("model", args.model_tag, f"differs from --model {args.model!r} (give one of them)")
        args.model = args.model_tag
    config = engine_config_from_args(args)
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails at once, in one line

    import uvicorn

    from kvinfer.engine.async_engine import AsyncLLMEngine
    from kvinfer.server.app import create_app, default_model_name
    from kvinfer.server.activity import EngineLine, server_logger
    from kvinfer.server.lifecycle import GracefulServer

    engine = AsyncLLMEngine.from_config(config, max_queue=args.max_queue)
    # A fatal engine failure (a lost tensor-parallel rank) stops the server the way Ctrl-C does; requests in
    # flight end with their error first, and the exit code says it failed.
    engine.on_dead = lambda: os.kill(os.getpid(), signal.SIGINT)
    name = args.served_model_name or default_model_name(config)
    app = create_app(engine, name, api_key=args.api_key, max_body_bytes=max_body,
                     shutdown_timeout=args.shutdown_timeout,
                     allowed_hosts=allowed_hosts,
                     responses_store_bytes=store_bytes, access_log=not args.quiet)
    app.state.embedding_pooling, app.state.embedding_normalize = args.pooling, args.normalize
    app.state.reasoning_parser = args.reasoning_parser
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logging.getLogger("kvinfer").warning("serving on %s without --api-key: anyone who can reach it can use it",
                                             args.host)
    port = sock.getsockname()[1]
    print(f"kvinfer: serving {name!r} on http://{args.host}:{port} (OpenAI API at /v1, web page at /)",
          file=sys.stderr)
    engine_line = None if args.quiet else EngineLine(engine.stats, server_logger()).start()
    try:
        # The lifecycle drains the requests and stops the engine before uvicorn's own shutdown begins.
        server = GracefulServer(uvicorn.Config(app, log_level=args.log_level, timeout_keep_alive=30,
                                               timeout_graceful_shutdown=5,
                                               access_log=args.log_level in ("debug", "info")),
                                app.state.lifecycle)
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a Ctrl-C outside the serving loop (before it started): nothing is running
        pass
    finally:
        if engine_line is not None:
            engine_line.stop()
        engine.shutdown()
    if engine._dead is not None:
        print(f"kvinfer: error: {engine._dead}", file=sys.stderr)
        return 1
    print("kvinfer: server stopped", file=sys.stderr)
    return 0
