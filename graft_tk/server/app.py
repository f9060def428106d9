"""graft-serve's HTTP side: OpenAI-compatible routes on Starlette (run by uvicorn).

    POST /v1/completions        text (or token ids) in, text out; ``stream`` as server-sent events
    POST /v1/chat/completions   messages in (the model's chat template applied), a message out
    GET  /v1/models             the one model served
    GET  /health                200 while the decode thread is alive
    GET  /metrics               Prometheus text format (graft_tk.server.metrics)

Every error is an OpenAI error body with its status; a handler never takes the server down.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..models import Model
from .protocol import APIError, Request, parse_request
from .scheduler import Job, Scheduler

log = logging.getLogger("graft_tk.server")
DISCONNECT_POLL_S = 0.25    # how often a waiting non-streaming handler checks that its client is still there
# How long an idle connection stays open. Longer than clients keep theirs (httpx, so the OpenAI
# client: 5 s; aiohttp: 15 s), so the client closes first: at uvicorn's default (5 s, equal to
# httpx's) a request sent on a connection the server was closing failed ("connection reset").
KEEP_ALIVE_S = 75
# The largest request body read (413 past it): a 32k-token prompt is ~130 KB of text, JSON-escaped
# maybe twice that; a client sending more is broken or hostile, and the body is held in memory.
MAX_BODY_BYTES = 4 << 20
# After --grace, the cancelled requests' last answers go out within a decode step (a prefill
# in progress runs to its end); uvicorn waits this much longer before it cancels a connection.
SHUTDOWN_MARGIN_S = 30.0


def create_app(scheduler: Scheduler, served_name: str) -> Starlette:
    target = scheduler.target
    metrics = scheduler.metrics

    def error(e: APIError) -> JSONResponse:
        metrics.reject(e.status)
        log.info("rejected %d %s: %s", e.status, e.code or e.type, e.message)
        return JSONResponse(e.body(), status_code=e.status)

    async def completions(request: HTTPRequest) -> Response:
        return await _generate(request, "completion")

    async def chat_completions(request: HTTPRequest) -> Response:
        return await _generate(request, "chat")

    async def _generate(http: HTTPRequest, kind: str) -> Response:
        try:
            try:
                body = json.loads(await _body(http))
            except (ValueError, RecursionError) as e:   # not JSON or not UTF-8, nested too deep, too many digits
                raise APIError(400, f"the request body is not valid JSON: {e}") from None
            req = parse_request(body, kind)
            if req.model != served_name:
                raise APIError(404, f"the model '{req.model}' does not exist here; this server serves "
                                    f"'{served_name}' (GET /v1/models)", param="model", code="model_not_found")
            ids = _prompt_ids(target, req, scheduler.max_model_len)
            job = Job(req, ids, target, asyncio.get_running_loop())
            scheduler.submit(job)
        except APIError as e:
            return error(e)
        if req.stream:
            return StreamingResponse(_events(job, served_name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        while not job.done:
            try:
                await asyncio.wait_for(job.wait(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    job.cancel()            # frees the decode thread after its current step
                    return Response(status_code=499)
        if job.error is not None:
            return error(APIError(500, f"decoding failed: {type(job.error).__name__}: {job.error}",
                                  type="server_error"))
        if job.shut_down:
            return error(_shut_down(job))
        return JSONResponse(_final(job, served_name))

    async def models(request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": served_name, "object": "model", "created": int(START), "owned_by": "graft_tk"}]})

    async def health(request: HTTPRequest) -> Response:
        alive = scheduler.alive
        return JSONResponse({"status": "ok" if alive else "decode thread stopped"}, status_code=200 if alive else 503)

    async def prometheus(request: HTTPRequest) -> Response:
        return PlainTextResponse(metrics.render(scheduler.queued, len(scheduler.running)),
                                 media_type="text/plain; version=0.0.4")

    async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
        return error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                              code="not_found" if exc.status_code == 404 else None))

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error})


START = time.time()


async def _body(http: HTTPRequest) -> bytes:
    """The request body, read up to MAX_BODY_BYTES (413 beyond: checked by Content-Length first,
    then while it streams in, so a body that lies about its length is cut too)."""
    too_large = APIError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB; send a shorter prompt",
                         code="request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    parts, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


def _prompt_ids(target: Model, req: Request, max_model_len: int) -> list[int]:
    tok = target.tokenizer
    if req.kind == "chat":
        if tok.chat_template is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            text = tok.apply_chat_template(list(req.prompt), add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template may raise on messages it does not take
            raise APIError(400, f"the model's chat template refused these messages: {type(e).__name__}: {e}",
                           param="messages") from None
        ids = tok.encode(text, add_special_tokens=False)
    elif isinstance(req.prompt, str):
        ids = tok.encode(req.prompt, add_special_tokens=True)
    else:
        ids = list(req.prompt)
        bad = [t for t in ids if not 0 <= t < target.config.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {target.config.vocab_size}); got e.g. {bad[:3]}",
                           param="prompt")
    if len(ids) + req.max_tokens > max_model_len:
        raise APIError(400, f"this server's maximum context length is {max_model_len} tokens (--max-model-len); the "
                            f"prompt has {len(ids)} and max_tokens asks for {req.max_tokens} more: shorten the prompt "
                            "or lower max_tokens", param="max_tokens", code="context_length_exceeded")
    return ids


def _usage(job: Job) -> dict:
    done = job.completion_tokens
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": done, "total_tokens": len(job.prompt_ids) + done}


def _choice(job: Job, text: str, finish_reason: str | None, stream: bool) -> dict:
    if job.request.kind == "completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    key = "delta" if stream else "message"
    message = {"role": "assistant", "content": text}
    return {"index": 0, key: message, "logprobs": None, "finish_reason": finish_reason}


def _envelope(job: Job, served_name: str, stream: bool) -> dict:
    kind = job.request.kind
    obj = ("chat.completion" if kind == "chat" else "text_completion") + (".chunk" if stream and kind == "chat" else "")
    return {"id": job.id, "object": obj, "created": int(job.created), "model": served_name}


def _final(job: Job, served_name: str) -> dict:
    return {**_envelope(job, served_name, False), "choices": [_choice(job, job.text, job.finish_reason, False)],
            "usage": _usage(job), "graft": _graft_stats(job)}


def _graft_stats(job: Job) -> dict:
    """What speculation did for this request (an extension field; OpenAI clients ignore it)."""
    s = job.stats
    keys = ("method", "steps", "mat", "tokens_per_s", "accepted_by_source", "prefill_seconds", "seconds")
    return {k: s[k] for k in keys if k in s}


async def _events(job: Job, served_name: str):
    """Server-sent events: one chunk per batch of new text, a last chunk with the finish reason
    (and usage), then [DONE]. A client that goes away cancels the job."""
    sent = 0
    try:
        while True:
            await job.wait()
            done, text = job.done, job.text      # done first: the final text is set before it
            if job.error is not None:
                yield _sse({"error": APIError(500, f"decoding failed: {job.error}", type="server_error").body()["error"]})
                break
            if len(text) > sent:
                yield _sse({**_envelope(job, served_name, True), "choices": [_choice(job, text[sent:], None, True)]})
                sent = len(text)
            if done and job.shut_down:
                yield _sse(_shut_down(job).body())
            elif done:
                yield _sse({**_envelope(job, served_name, True), "choices": [_choice(job, "", job.finish_reason, True)],
                            "usage": _usage(job)})
            if done:
                yield "data: [DONE]\n\n"
                break
    finally:
        if not job.done:
            job.cancel()


def _shut_down(job: Job) -> APIError:
    return APIError(503, f"the server shut down before this request finished ({len(job.tokens)} tokens decoded, "
                         "not all sent); send it again when the server is back", type="server_error",
                    code="server_shutdown")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def http_server(app: Starlette, scheduler: Scheduler | None = None, grace: float | None = None):
    """The uvicorn server graft-serve runs ``app`` on. With ``scheduler`` and ``grace``: at SIGTERM /
    Ctrl-C the scheduler stops accepting, lets the requests in flight finish for ``grace`` seconds,
    then cancels the rest, whose clients get a 503 error (a streaming one as its last event);
    uvicorn waits SHUTDOWN_MARGIN_S longer for those answers to go out before it cancels anything."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if scheduler is not None and not self.should_exit:
                threading.Thread(target=scheduler.shutdown, args=(grace or 0.0,), daemon=True).start()
            super().handle_exit(sig, frame)

    timeout = None if grace is None else grace + SHUTDOWN_MARGIN_S
    return Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S,
                                 timeout_graceful_shutdown=timeout))


@contextlib.contextmanager
def serving_in_thread(scheduler: Scheduler, served_name: str, start_timeout: float = 30.0):
    """The app on uvicorn in a background thread of this process, on a free loopback port (tests,
    bench/serve_load.py): yields the base URL ``http://127.0.0.1:PORT``; on exit the server stops and
    the scheduler shuts down."""
    server = http_server(create_app(scheduler, served_name))
    sock = socket.create_server(("127.0.0.1", 0))
    scheduler.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    try:
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {start_timeout:.0f} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        scheduler.shutdown(grace=0)
