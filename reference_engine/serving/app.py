"""The server's HTTP routes (FastAPI). Each parses, calls one function and replies; a
`ProtocolError` raised anywhere below a route becomes its OpenAI-style error body.

The API key, when set, is one dependency (`api_key_check`) on the routes it protects: the
/v1/ routes, and with --api-key-scope all every route but /health, FastAPI's documentation
pages included (re-added here as routes that take dependencies).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .limits import read_body
from .protocol import DEFAULT_TEMPERATURE, ParsedRequest, ProtocolError
from .replies import error_json, respond

if TYPE_CHECKING:
    from .service import Server

TITLE = "DFlash reference server"
# a completions body up to this size is decoded and tokenised on the event loop (well under a
# millisecond); a larger one, and a chat body (its template is the checkpoint's code), on a
# worker thread, which under load waits for the interpreter lock (5 ms at a time) before it
# starts and again after tokenising: several milliseconds of the request's time to first token
INLINE_PARSE_BYTES = 2048


def create_app(server: Server) -> FastAPI:
    app = FastAPI(
        title=TITLE, lifespan=server.lifecycle.lifespan, openapi_url=None, docs_url=None, redoc_url=None
    )  # added below: see _add_docs
    app.add_exception_handler(ProtocolError, _error_response)
    # the routes that each --api-key-scope protects
    scope_api = [] if server.api_key is None else [Depends(api_key_check(server.api_key))]
    scope_all = scope_api if server.api_key_scope == "all" else []
    served_since = int(time.time())  # /v1/models' `created`: when this server took its model

    async def admitted() -> None:
        server.lifecycle.admit()

    generating = [*scope_api, Depends(admitted)]

    @app.get("/health")
    async def health():
        body, status = server.lifecycle.health()
        return JSONResponse(body, status_code=status)

    @app.get("/info", dependencies=scope_all)
    async def info():
        """What a benchmark records about this server (harness meta.json, the report's run table)."""
        engine = server.info
        return {
            "model": server.name,
            "torch": torch.__version__,
            "device": engine.device,
            "dtype": engine.dtype,
            "numerics": engine.numerics,
            "mode": "dflash" if engine.speculative else "plain",
            "block_size": engine.block_size,
            "max_num_seqs": engine.max_num_seqs,
            "threads": engine.threads,
            "engine_loop": server.loop_mode,
            "default_temperature": DEFAULT_TEMPERATURE,
        }

    @app.get("/v1/models", dependencies=scope_api)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.name,
                    "object": "model",
                    "created": served_since,
                    "owned_by": "reference_engine",
                }
            ],
        }

    @app.get("/metrics", dependencies=scope_all)
    async def metrics(request: Request):
        # OpenMetrics for a scraper that asks for it (Prometheus sends it first in Accept)
        openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
        page, content_type = server.metrics.render(server.lifecycle.totals(), openmetrics)
        return Response(page, media_type=content_type)

    @app.post("/v1/completions", dependencies=generating)
    async def completions(request: Request):
        arrival_s = time.monotonic()
        parsed = await read_request(server, request, chat=False)
        return await respond(server, parsed, arrival_s)

    @app.post("/v1/chat/completions", dependencies=generating)
    async def chat_completions(request: Request):
        arrival_s = time.monotonic()
        parsed = await read_request(server, request, chat=True)
        return await respond(server, parsed, arrival_s)

    _add_docs(app, scope_all)
    return app


def api_key_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    """The dependency that refuses (401) a request without 'Authorization: Bearer <api_key>'."""

    async def require_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        # constant time: the comparison does not tell how much of a guess was right
        if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
            raise ProtocolError("missing or wrong API key", None, 401, "authentication_error")

    return require_api_key


async def read_request(server: Server, request: Request, chat: bool) -> ParsedRequest:
    """The request's body, bounded (413), decoded and tokenised (400, 404)."""
    raw = await read_body(request, server.limits)
    if not chat and len(raw) <= INLINE_PARSE_BYTES:
        return server.parse(raw, chat)
    # decoding and tokenising a large body take a while, and a chat template (the
    # checkpoint's own code) may: not on the event loop
    return await asyncio.to_thread(server.parse, raw, chat)


def _add_docs(app: FastAPI, dependencies: list) -> None:
    """FastAPI's own documentation pages, at their usual paths, as routes that take
    `dependencies` (FastAPI adds its own as plain routes that no dependency reaches)."""

    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{TITLE} - Swagger UI",
            oauth2_redirect_url="/docs/oauth2-redirect",
        )

    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{TITLE} - ReDoc")

    for path, page in (
        ("/openapi.json", openapi),
        ("/docs", swagger_ui),
        ("/docs/oauth2-redirect", swagger_ui_redirect),
        ("/redoc", redoc),
    ):
        app.add_api_route(
            path, page, methods=["GET", "HEAD"], include_in_schema=False, dependencies=dependencies
        )


async def _error_response(request: Request, exc: ProtocolError) -> JSONResponse:
    return JSONResponse(error_json(exc), status_code=exc.status)
