"""`spectr-edge serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn, server-sent events).

    POST /v1/chat/completions   messages -> the assistant's message (stream or not)
    POST /v1/completions        prompt -> its continuation (stream or not)
    GET  /v1/models             the one model this server serves
    GET  /health                {"status": "ok"}
    GET  /metrics               tokens/s, acceptance, tokens per target call, queue length, requests

Request fields: max_tokens (or max_completion_tokens), temperature, top_p, seed, stop (a string or
a list), n (1 only), stream (with stream_options.include_usage), presence_penalty,
frequency_penalty; beside OpenAI's, top_k and repetition_penalty (as llama.cpp's server and vLLM
take them) and "speculation": {drafter, num_candidates, branches, lookup_candidates, draft_len,
draft_stop, adaptive, tree_budget, draft_window} over the server's own speculation flags. Usage
counts prompt, completion and cached prompt tokens (prompt_tokens_details.cached_tokens: the tokens
whose KV cache an earlier request left, prefix_cache.py).

Generations run one at a time, in arrival order (an asyncio lock is first come, first served);
at most `max_queue` wait, more get 429. A client that disconnects stops its generation between two
steps. Errors are OpenAI's JSON (400 bad request or prompt over the context, 413 body too large,
429 queue full, 503 shutting down), never a traceback. The server listens on 127.0.0.1 unless told
otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field

from . import options as check
from .errors import InputError, SpectrError
from .generator import GenerationResult, Generator
from .options import POLICY_KEYS

SPECULATION_KEYS = POLICY_KEYS + ("draft_window",)


@dataclass
class ServerSettings:
    model_name: str = "spectr-edge"
    max_queue: int = 16                     # requests waiting beyond the one being generated
    max_body_bytes: int = 1 << 20           # 1 MiB of JSON
    max_tokens: int = 4096                  # the most tokens one request may ask for
    speculation: dict = field(default_factory=dict)   # the server's drafting flags (per-request overrides win)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self):
        from starlette.responses import JSONResponse

        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class Metrics:
    """What /metrics reports, over every request served."""

    def __init__(self):
        self.requests = self.completed = self.cancelled = self.failed = 0
        self.tokens = self.target_calls = self.drafted = self.accepted = self.cached_tokens = 0
        self.seconds = 0.0
        self.started = time.time()

    def add(self, result: GenerationResult) -> None:
        s = result.stats
        self.tokens += s.new_tokens
        self.target_calls += max(0, s.target_calls - 1)
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.cached_tokens += s.cached_tokens
        self.seconds += s.seconds_total

    def report(self, waiting: int, busy: bool) -> dict:
        return {"requests": self.requests, "completed": self.completed, "cancelled": self.cancelled,
                "failed": self.failed, "queue_length": waiting, "generating": busy,
                "generated_tokens": self.tokens, "tokens_per_second": self.tokens / self.seconds if self.seconds else 0.0,
                "tokens_per_target_call": self.tokens / self.target_calls if self.target_calls else 0.0,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "cached_prompt_tokens": self.cached_tokens, "uptime_seconds": time.time() - self.started}


def _number(body: dict, key: str, default):
    value = body.get(key, default)
    return default if value is None else value


def generation_options(body: dict, settings: ServerSettings) -> dict:
    """The Generator options of one request (checked by the Generator itself: a bad value is a 400)."""
    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "n must be 1: this server generates one choice per request", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = settings.max_tokens if max_tokens is None else max_tokens
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > settings.max_tokens:
        raise ApiError(400, f"max_tokens is {max_tokens}, more than this server's limit of {settings.max_tokens}",
                       param="max_tokens")
    options = dict(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
                   top_p=_number(body, "top_p", 1.0), top_k=_number(body, "top_k", 0),
                   presence_penalty=_number(body, "presence_penalty", 0.0),
                   frequency_penalty=_number(body, "frequency_penalty", 0.0),
                   repetition_penalty=_number(body, "repetition_penalty", 1.0),
                   seed=body.get("seed"), stop=body.get("stop") or ())
    speculation = dict(settings.speculation)
    extra = body.get("speculation") or {}
    if not isinstance(extra, dict) or set(extra) - set(SPECULATION_KEYS):
        raise ApiError(400, f"speculation takes an object with {', '.join(SPECULATION_KEYS)}", param="speculation")
    speculation.update(extra)
    return {**options, **speculation}


def create_app(gen: Generator, settings: ServerSettings | None = None):
    """The ASGI application serving `gen`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    settings = settings or ServerSettings()
    lock, metrics = asyncio.Lock(), Metrics()
    state = {"waiting": 0, "closing": False}

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            raise ApiError(413, f"the request body is {length} bytes, more than {settings.max_body_bytes}",
                           code="request_too_large")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > settings.max_body_bytes:
                raise ApiError(413, f"the request body is more than {settings.max_body_bytes} bytes",
                               code="request_too_large")
        try:
            value = json.loads(body)
        except (UnicodeDecodeError, ValueError) as err:
            raise ApiError(400, f"the request body is not valid JSON ({err})") from None
        if not isinstance(value, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return value

    def prompt_ids(body: dict, chat: bool) -> list[int]:
        if chat:
            return gen.codec.encode_chat(_messages(body))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string (one prompt per request)", param="prompt")
        return gen.codec.encode_prompt(prompt, chat=False)

    async def admitted():
        """Wait for our turn; 429 when too many wait already, 503 when the server is closing."""
        if state["closing"]:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        if state["waiting"] >= settings.max_queue and lock.locked():
            raise ApiError(429, f"{state['waiting']} requests are queued already; retry later", kind="rate_limit_error",
                           code="queue_full")
        state["waiting"] += 1
        try:
            await lock.acquire()
        finally:
            state["waiting"] -= 1

    async def completion(request: Request, chat: bool):
        try:
            body = await read_json(request)
            options = generation_options(body, settings)
            ids = prompt_ids(body, chat)
            context = gen.engine.context_length
            if len(ids) >= context:
                raise ApiError(400, f"the prompt is {len(ids)} tokens but the context is {context}; shorten it",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            options["max_new_tokens"] = min(options["max_new_tokens"], context - len(ids)) \
                if isinstance(options["max_new_tokens"], int) else options["max_new_tokens"]
            gen.options(**{k: v for k, v in options.items() if k not in ("seed", "stop")})   # 400 before queueing
            check.seed(options["seed"])
            check.stop_strings(options["stop"])
            await admitted()
        except ApiError as err:
            return err.response()
        except SpectrError as err:
            return ApiError(400, str(err)).response()
        metrics.requests += 1
        result = GenerationResult("", [])
        job = Job(_aiter_pieces(gen._text(ids, result, **options)), lock)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            # the background task ends the job even when the client left before the stream started
            return StreamingResponse(_events(job, result, rid, created, chat, usage), media_type="text/event-stream",
                                     background=BackgroundTask(job.finish))
        try:
            text = ""
            async for piece in job.stream:
                text += piece
                if await request.is_disconnected():
                    metrics.cancelled += 1
                    return JSONResponse({}, status_code=499)
        except SpectrError as err:
            metrics.failed += 1
            return ApiError(400, str(err)).response()
        finally:
            await job.finish()
        metrics.completed += 1
        metrics.add(result)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat else
                  {"index": 0, "text": text, "logprobs": None})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                             "model": settings.model_name,
                             "choices": [{**choice, "finish_reason": _finish(result)}], "usage": _usage(result)})

    async def _events(job, result, rid, created, chat, usage):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta=None, finish=None, with_usage=None):
            choice = ({"index": 0, "delta": delta or {}, "finish_reason": finish} if chat else
                      {"index": 0, "text": (delta or {}).get("content", ""), "finish_reason": finish, "logprobs": None})
            data = {"id": rid, "object": kind, "created": created, "model": settings.model_name,
                    "choices": [] if with_usage else [choice]}
            if with_usage:
                data["usage"] = with_usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            async for piece in job.stream:
                yield chunk({"content": piece})
            yield chunk({}, _finish(result))
            if usage:
                yield chunk(with_usage=_usage(result))
            yield "data: [DONE]\n\n"
            finished = True
        except SpectrError as err:
            metrics.failed += 1
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'invalid_request_error'}})}\n\n"
        finally:
            if not finished:                       # the client went away, or an error: stop generating
                metrics.cancelled += 1
            await job.finish()
            if finished:
                metrics.completed += 1
                metrics.add(result)

    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    async def completions(request: Request):
        return await completion(request, chat=False)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                                          "created": int(metrics.started), "owned_by": "spectr-edge"}]})

    async def health(request: Request):
        if state["closing"]:
            return ApiError(503, "the server is shutting down", kind="server_error").response()
        return JSONResponse({"status": "ok"})

    async def metrics_report(request: Request):
        return JSONResponse(metrics.report(state["waiting"], lock.locked()))

    async def http_error(request: Request, exc: HTTPException):
        return ApiError(exc.status_code, str(exc.detail), kind="invalid_request_error").response()

    async def any_error(request: Request, exc: Exception):
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}"[:300], kind="server_error").response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state["closing"] = True                    # shutting down: new requests get 503

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_report, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: any_error},
                     lifespan=lifespan)


class Job:
    """One admitted generation: its stream of text pieces and the turn it holds; finish() (idempotent)
    stops the generation between steps and gives the turn to the next request."""

    def __init__(self, stream, lock: asyncio.Lock):
        self.stream, self.lock, self.done = stream, lock, False

    async def finish(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            await self.stream.aclose()
        finally:
            self.lock.release()


def _messages(body: dict) -> list:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    from .options import messages

    try:
        return messages(value)
    except InputError as err:
        raise ApiError(400, str(err), param="messages") from None


def _finish(result: GenerationResult) -> str:
    return "length" if result.stats.stop_reason in ("max_new_tokens", "context") else "stop"


def _usage(result: GenerationResult) -> dict:
    s = result.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": s.prompt_tokens + len(result.token_ids),
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


def _aiter_pieces(pieces):
    from .generator import _async_iter

    return _async_iter(pieces)


def serve(gen: Generator, host: str = "127.0.0.1", port: int = 8080, settings: ServerSettings | None = None) -> None:
    """Run the server until interrupted."""
    import uvicorn

    uvicorn.run(create_app(gen, settings), host=host, port=port, log_level="warning")
