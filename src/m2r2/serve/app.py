"""The HTTP side of ``m2r2 serve``: an OpenAI-compatible FastAPI app over a :class:`Scheduler`.

Handlers validate and tokenize (cheap), submit a :class:`Job`, and relay its :class:`Update`s from
the scheduler thread through an asyncio queue: as server-sent events when streaming, as one JSON
object otherwise. A client that goes away cancels its job, which frees its batch slot and cache at
the next step. Runs on loopback unless told otherwise; with an API key every ``/v1`` route wants
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from m2r2.errors import M2R2Error
from m2r2.serve.protocol import (
    FINISH,
    APIError,
    ParsedRequest,
    TextStream,
    bad,
    chunk,
    context_error,
    new_id,
    parse_chat,
    parse_completion,
    response,
    usage,
)
from m2r2.serve.scheduler import Job, QueueFull, Scheduler, Update

if TYPE_CHECKING:
    from collections.abc import Iterator

    import uvicorn

    from m2r2.engine import Engine

log = logging.getLogger("m2r2.serve")
#: Request bodies larger than this many bytes per context token are refused (413) before parsing.
BODY_BYTES_PER_TOKEN = 32
#: How often a non-streaming handler checks whether its client is still there (seconds).
DISCONNECT_POLL_S = 0.25


def model_id(spec: str | None, model_dir: Path) -> str:
    """The name clients use in ``model``: the bundled name, or the directory / GGUF file stem."""
    from m2r2.loading import BUNDLED, DEFAULT_MODEL

    if spec is None or spec in BUNDLED:
        return spec or DEFAULT_MODEL
    return Path(spec).stem if Path(spec).suffix == ".gguf" else model_dir.name


def create_app(engine: Engine, scheduler: Scheduler, name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``name`` through ``scheduler``."""
    app = FastAPI(title="m2r2", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    served = [name]
    max_body = BODY_BYTES_PER_TOKEN * engine.context
    tok = engine.tokenizer

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error(APIError(e.status_code, str(e.detail), type=kind, headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return error(bad(None, f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")  # the traceback goes to the server log, never to the client
        return error(APIError(500, "internal server error", type="server_error", code="internal_error"))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not given:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise APIError(413, f"the request body exceeds {max_body} bytes", code="request_too_large")
        raw = await request.body()
        if len(raw) > max_body:
            raise APIError(413, f"the request body exceeds {max_body} bytes", code="request_too_large")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(None, f"the request body is not valid JSON: {e}", "invalid_json") from None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, **scheduler.status()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [_model_card(name)]}

    @app.get("/v1/models/{mid:path}")
    async def model(mid: str, request: Request) -> dict[str, Any]:
        check_key(request)
        if mid not in served:
            raise APIError(404, f"the model {mid!r} does not exist", param="model", code="model_not_found")
        return _model_card(name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        req = parse_chat(await read_json(request), served)
        assert req.messages is not None
        try:
            ids = tok.encode_chat(req.messages)
        except M2R2Error as e:
            raise bad("messages", str(e)) from None
        return await run(request, req, ids, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        req = parse_completion(await read_json(request), served, engine.model.cfg.vocab_size)
        ids = req.prompt if isinstance(req.prompt, list) else tok.encode(str(req.prompt))
        if not ids:
            raise bad("prompt", "the prompt encodes to no tokens")
        return await run(request, req, ids, chat=False)

    async def run(request: Request, req: ParsedRequest, ids: list[int], chat: bool) -> Response:
        if len(ids) >= engine.context:
            raise context_error(len(ids), engine.context)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Update] = asyncio.Queue()

        def emit(u: Update) -> None:  # called from the scheduler thread
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, u)

        job = Job(list(ids), req.gen, emit)
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise APIError(
                429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(e.retry_after)}
            ) from None
        rid = new_id("chatcmpl" if chat else "cmpl")
        text = TextStream(tok.decode, req.gen.stop)
        if req.stream:
            return StreamingResponse(
                stream(job, queue, text, rid, req, chat, len(ids)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            tokens: list[int] = []
            checked = loop.time()
            while True:
                try:
                    u: Update | None = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    u = None
                if loop.time() - checked >= DISCONNECT_POLL_S:  # tokens may flow without pause: check by time
                    checked = loop.time()
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; `finally` cancels the job
                if u is None:
                    continue
                if u.error is not None:
                    raise _as_api_error(u.error)
                tokens += u.tokens
                if u.done:
                    break
        finally:
            scheduler.cancel(job)  # no-op once done; frees the slot if this handler is cancelled
        text.feed(tokens, final=True)
        fin = FINISH.get(str(u.finish_reason), "stop")
        return JSONResponse(response(rid, req.model, chat, text.text, fin, usage(len(ids), len(tokens)), u.stats or {}))

    async def stream(
        job: Job, queue: asyncio.Queue[Update], text: TextStream, rid: str, req: ParsedRequest, chat: bool, n_in: int
    ) -> AsyncIterator[str]:
        def sse(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        n_out = 0
        try:
            if chat:
                yield sse(chunk(rid, req.model, chat, {"role": "assistant", "content": ""}))
            while True:
                u = await queue.get()
                if u.error is not None:
                    yield sse(_as_api_error(u.error).body())
                    break
                n_out += len(u.tokens)
                delta = text.feed(u.tokens, final=u.done)
                if u.done:
                    fin = FINISH.get(str(u.finish_reason), "stop")
                    body = {"content": delta} if chat else delta
                    yield sse(chunk(rid, req.model, chat, body, fin, {"m2r2": u.stats or {}}))
                    if req.include_usage:
                        yield sse(chunk(rid, req.model, chat, None, extra={"usage": usage(n_in, n_out)}))
                    break
                if delta:
                    yield sse(chunk(rid, req.model, chat, {"content": delta} if chat else delta))
            yield "data: [DONE]\n\n"
        finally:
            scheduler.cancel(job)  # the client went away (or the stream ended): free the slot

    return app


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "m2r2"}


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, M2R2Error):
        return bad(None, str(e))
    return APIError(500, "internal server error while decoding", type="server_error", code="internal_error")


def build(
    engine: Engine,
    name: str,
    method: str = "auto",
    max_batch: int = 8,
    max_queue: int = 64,
    api_key: str | None = None,
) -> FastAPI:
    """Scheduler plus app for ``engine`` (the scheduler thread starts now; ``app.state.scheduler.close()`` stops it)."""
    return create_app(engine, Scheduler(engine, method, max_batch, max_queue), name, api_key)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until interrupted, then stop its scheduler."""
    import uvicorn

    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        app.state.scheduler.close()


@contextmanager
def background(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a thread on a free loopback port (``port=0``); yields the base URL ``http://host:port``.

    Used by the tests and ``m2r2 bench --suite serve``; the scheduler is stopped on exit.
    """
    import socket

    import uvicorn

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server: uvicorn.Server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="m2r2-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise M2R2Error(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.scheduler.close()
