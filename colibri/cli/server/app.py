"""`colibri serve`'s HTTP face: OpenAI's API on Starlette, one batch engine behind it.

Starlette (on uvicorn) because it is the small ASGI core FastAPI itself stands on: routing,
streaming responses and a test client, nothing this server does not use. Requests are
checked (`openai_api`), tokenized off the event loop, and handed to the `Engine`; a stream is
OpenAI's server-sent events, and a client that goes away mid-stream frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import json

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from colibri.formats.safe_json import loads
from colibri.cli.server import openai_api
from colibri.cli.server.engine_thread import Engine, Request
from colibri.cli.server.openai_api import APIError

MAX_BODY_BYTES = 32 << 20  # a completion request larger than this is refused (413)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def read_json(request: HTTPRequest, limit: int = MAX_BODY_BYTES):
    """The body as JSON, refused past `limit` bytes without reading further."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(part)
    return loads(b"".join(chunks), "request body", ValueError)


OPEN_PATHS = ("/health", "/")  # answered without the API key


class Server:
    """The app's state: the model, its engine and the name it is served under."""

    def __init__(self, model, name: str, api_key: str | None = None):
        from colibri.cli.server.live import History, RecentRouting
        from colibri.cli.server.metrics import registry_for

        self.model, self.name, self.api_key = model, name, api_key
        self.engine = Engine(model)
        self.registry = registry_for(self.engine)
        self.routing = model.decoder.route_log = RecentRouting(model.config.moe_layers, model.config.n_experts)
        self.history = History(self.engine)

    def close(self) -> None:
        """Stop the history's sampling and the engine (after the requests it holds end)."""
        self.history.close()
        self.engine.close()

    def authorized(self, request: HTTPRequest) -> bool:
        if self.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    # --- routes ------------------------------------------------------------------

    async def health(self, request: HTTPRequest) -> Response:
        failure = self.engine.failure
        return JSONResponse({"status": "error", "error": str(failure)} if failure else {"status": "ok"},
                            status_code=503 if failure else 200)

    async def metrics(self, request: HTTPRequest) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def live_page(self, request: HTTPRequest) -> Response:
        from colibri.cli.server.live import PAGE

        return HTMLResponse(PAGE.replace('<span id="model"></span>', f'<span id="model">{html.escape(self.name)}</span>'))

    async def live_json(self, request: HTTPRequest) -> Response:
        from colibri.cli.server.live import live_numbers

        return JSONResponse({"model": self.name, **live_numbers(self.engine, self.routing, self.history)})

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "colibri"}

    async def completions(self, request: HTTPRequest) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self.generate(request, chat=True)

    async def generate(self, request: HTTPRequest, chat: bool) -> Response:
        try:
            body = await read_json(request)
        except ValueError as e:
            raise APIError(400, f"malformed JSON: {e}") from None
        job = await run_in_threadpool(openai_api.make_job, body, chat, self.model, self.name)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(event):
            loop.call_soon_threadsafe(events.put_nowait, event)

        work = self.engine.submit(Request(job.prompt, job.sampling, on_event, interactive=True))
        if job.stream:
            return StreamingResponse(self.stream(job, work, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            pieces = []
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise APIError(500, f"the engine failed: {event}", kind="server_error")
                pieces.append(event.text)
                if event.finish_reason is not None:
                    break
        finally:
            if not work.done.is_set():
                self.engine.cancel(work)
        return JSONResponse(openai_api.response(job, self.name, "".join(pieces), event.finish_reason,
                                                event.numbers["generated_tokens"]))

    async def stream(self, job, work, events):
        """Server-sent events as OpenAI sends them, ending with `data: [DONE]`."""
        try:
            if job.chat:
                yield _sse(openai_api.chunk(job, self.name, None, None, first=True))
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    yield _sse(APIError(500, f"the engine failed: {event}", kind="server_error").body())
                    break
                if event.text or event.finish_reason:
                    yield _sse(openai_api.chunk(job, self.name, event.text, event.finish_reason))
                if event.finish_reason:
                    if job.include_usage:
                        yield _sse(openai_api.usage_chunk(job, self.name, event.numbers["generated_tokens"]))
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): the slot is freed either way
            if not work.done.is_set():
                self.engine.cancel(work)


def _sse(value: dict) -> str:
    return f"data: {json.dumps(value, ensure_ascii=False)}\n\n"


def build_app(server: Server, extra_routes=(), closers=()):
    """The ASGI app: the routes, OpenAI-style errors, the API key check; `closers` run at
    shutdown before the server closes."""
    routes = [
        Route("/", server.live_page),
        Route("/live.json", server.live_json),
        Route("/health", server.health),
        Route("/metrics", server.metrics),
        Route("/v1/models", server.models),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        *extra_routes,
    ]

    async def on_api_error(request, error: APIError):
        return error_response(error)

    async def not_found(request, error):
        return error_response(APIError(getattr(error, "status_code", 404), f"no route {request.method} {request.url.path}",
                                       code="not_found"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        for close in closers:
            close()
        server.close()

    app = Starlette(routes=routes, exception_handlers={APIError: on_api_error, 404: not_found, 405: not_found},
                    lifespan=lifespan)

    async def require_key(scope, receive, send):
        """With --api-key, every route but /health and the live page (which holds no data: it asks
        for the key to read /live.json) answers 401 to a missing or wrong Bearer token."""
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not server.authorized(HTTPRequest(scope)):
            response = error_response(APIError(401, "Incorrect API key provided", code="invalid_api_key"))
            return await response(scope, receive, send)
        return await app(scope, receive, send)

    return require_key
