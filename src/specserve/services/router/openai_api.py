"""The OpenAI-compatible HTTP API on the router (FastAPI on uvicorn, beside gRPC in the same
event loop): /v1/completions, /v1/chat/completions (SSE when stream), /v1/models, /health.

A request is validated by the pydantic bodies of `openai_schema`, converted to the same
GenerateRequest a gRPC client sends, and served by the same GenerationService (service.py), in
process: sessions, rounds, Redis, traces and metrics are the gRPC path's. Errors are OpenAI
error objects with the status codes its SDK maps to exceptions (ADR 0012)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from redis.exceptions import RedisError

from specserve.control.policy import ADAPTER_NAME
from specserve.errors import (
    AdapterNotFound,
    InvalidRequest,
    ResourceExhausted,
    SessionLost,
    SessionNotFound,
    Unavailable,
)
from specserve.services.router.openai_schema import (
    ChatRequest,
    CompletionRequest,
    CompletionTokensDetails,
    ModelCard,
    ModelList,
    SpeculationUsage,
    Usage,
    now,
)
from specserve.services.router.service import GenerationService
from specserve.serving.chat import ChatTemplate
from specserve.serving.metrics import RouterMetrics
from specserve.serving.telemetry import API, tracer
from specserve.v1 import generation_pb2

log = logging.getLogger("specserve.router.http")

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(exc: Exception) -> APIError:
    """A domain exception as the OpenAI error its SDK raises for the status."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), "invalid_request_error")
    if isinstance(exc, AdapterNotFound):  # the request's `model`, an adapter no target has (ADR 0029)
        return APIError(404, str(exc), "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, SessionNotFound):
        return APIError(404, str(exc), "invalid_request_error", "not_found")
    if isinstance(exc, ResourceExhausted):  # the target had no KV room within admission_wait_s
        return APIError(429, f"{exc}; retry shortly, or with fewer concurrent requests", "rate_limit_error",
                        "resource_exhausted")
    if isinstance(exc, Unavailable | SessionLost):
        return APIError(503, f"{exc}; retry the request (with the same Idempotency-Key to join it)",
                        "service_unavailable", "unavailable")
    if isinstance(exc, RedisError | ConnectionError):
        return APIError(503, "the session store (Redis) is unreachable; retry later", "service_unavailable",
                        "unavailable")
    log.exception("HTTP request failed")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    where = ".".join(loc)
    return APIError(400, f"{where}: {msg}" if where else msg, "invalid_request_error", "invalid_value",
                    where or None)


class OpenAIApp:
    """The routes over one GenerationService; `ready()` says whether the router serves."""

    def __init__(self, service: GenerationService, model_id: str, chat: ChatTemplate, api_keys: set[str],
                 max_in_flight: int, ready: Callable[[], bool], metrics: RouterMetrics | None = None) -> None:
        self.service = service
        self.model_id = model_id
        self.chat = chat
        self.api_keys = api_keys
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.ready = ready
        self.metrics = metrics
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(APIError, self._error)  # type: ignore[arg-type]  # Starlette types the handler by Exception
        app.add_exception_handler(RequestValidationError, lambda r, e: self._error(r, _validation_error(e)))
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models/{model_id}", self.model, methods=["GET"])
        return app

    def _error(self, request: Request, err: APIError) -> JSONResponse:
        """Every refused request is answered, and counted, here (auth, model, body, serving)."""
        self._count(request, err.status)
        return JSONResponse(err.body(), err.status)

    def _adapter_of(self, model_id: str) -> str:
        """The LoRA adapter a request's `model` names (ADR 0029, as vLLM: an adapter's name), or
        "" for the base model; whether a target has it loaded is the service's to check."""
        if model_id == self.model_id:
            return ""
        if not ADAPTER_NAME.match(model_id):
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {self.model_id!r} and "
                           "its LoRA adapters (GET /v1/models)", "invalid_request_error", "model_not_found", "model")
        return model_id

    async def health(self) -> JSONResponse:
        ok = self.ready()
        return JSONResponse({"status": "ok" if ok else "starting"}, 200 if ok else 503)

    async def models(self, request: Request) -> ModelList:
        """The base model, and every LoRA adapter a live target has loaded (ADR 0029)."""
        self._authorize(request)
        adapters = sorted(await self.service.sessions.targets.adapters())
        return ModelList(data=[ModelCard(id=self.model_id),
                               *(ModelCard(id=a, root=self.model_id, parent=self.model_id) for a in adapters)])

    async def model(self, model_id: str, request: Request) -> ModelCard:
        self._authorize(request)
        adapter = self._adapter_of(model_id)
        if not adapter:
            return ModelCard(id=self.model_id)
        try:
            await self.service.sessions.targets.require_adapter(adapter)
        except AdapterNotFound as exc:
            raise api_error(exc) from exc
        return ModelCard(id=adapter, root=self.model_id, parent=self.model_id)

    async def completions(self, body: CompletionRequest, request: Request):
        req = self._generate_request(body, request, COMPLETION_DEFAULT_TOKENS)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
            req.prompt_ids.ids.extend(body.prompt)
        else:
            req.prompt = body.prompt if isinstance(body.prompt, str) else str(body.prompt[0]) if body.prompt else ""
        return await self._serve(req, body, request, "text_completion", "cmpl")

    async def chat_completions(self, body: ChatRequest, request: Request):
        req = self._generate_request(body, request, self.service.settings.max_tokens_limit)
        try:
            messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                        for m in body.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error", param="messages") from exc
        req.prompt = self.chat.render(messages)
        return await self._serve(req, body, request, "chat.completion", "chatcmpl")

    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if not key:
            raise APIError(401, "missing API key: send it as 'Authorization: Bearer <key>'",
                           "invalid_request_error", "invalid_api_key")
        if scheme.lower() != "bearer" or key.strip() not in self.api_keys:
            raise APIError(401, "incorrect API key", "invalid_request_error", "invalid_api_key")

    def _generate_request(self, body: CompletionRequest | ChatRequest, request: Request,
                          default_tokens: int) -> generation_pb2.GenerateRequest:
        self._authorize(request)
        req = generation_pb2.GenerateRequest(adapter=self._adapter_of(body.model),
            max_tokens=body.budget(default_tokens), temperature=body.temperature, top_k=body.top_k,
            stop=body.stops(), workload_class=body.workload_class, draft_pool=body.draft_pool,
            request_id=request.headers.get("idempotency-key", ""),
            prediction=body.prediction.text() if body.prediction else "")
        if body.top_p < 1.0:
            req.top_p = body.top_p
        if body.seed is not None:
            req.seed = body.seed
        if body.num_draft_tokens is not None:
            req.num_draft_tokens = body.num_draft_tokens
        try:
            constraint = body.constraint()
        except InvalidRequest as exc:
            raise APIError(400, str(exc), "invalid_request_error", param="response_format") from exc
        if constraint is not None:
            constraint.to_proto(req.constraint)
        return req

    async def _serve(self, req: generation_pb2.GenerateRequest, body, request: Request, kind: str, prefix: str):
        if self.in_flight >= self.max_in_flight:
            raise APIError(429, f"the router is serving {self.in_flight} HTTP requests, its limit; retry shortly",
                           "rate_limit_error", "rate_limit_exceeded")
        # a SERVER span per request, the child of the caller's traceparent, as gRPC's interceptor
        parent = propagate.extract(dict(request.headers))
        span = tracer().start_span(f"POST {request.url.path}", context=parent, kind=SpanKind.SERVER,
                                   attributes={"specserve.api": "http"})
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        api = API.set("http")
        self.in_flight += 1
        done = True
        try:
            if body.stream:
                stream = await self._stream(req, body, kind, prefix, span)
                done = False  # the stream ends the span
            else:
                resp = await self.service.generate(req)
            self._count(request, 200)
            return stream if body.stream else self._response(resp, body, kind, prefix, self._prompt_tokens(req))
        except Exception as exc:
            err = api_error(exc)
            span.set_status(Status(StatusCode.ERROR, err.message))
            raise err from exc  # answered and counted by _error
        finally:
            API.reset(api)
            otel_context.detach(token)
            if done:
                self.in_flight -= 1
                span.end()

    def _count(self, request: Request, status: int) -> None:
        if self.metrics is not None:
            self.metrics.api_requests.labels("http", request.url.path, str(status)).inc()

    def _prompt_tokens(self, req: generation_pb2.GenerateRequest) -> int:
        if req.WhichOneof("input") == "prompt_ids":
            return len(req.prompt_ids.ids)
        return len(self.service.model.encode(req.prompt))

    def _response(self, resp: generation_pb2.GenerateResponse, body, kind: str, prefix: str,
                  prompt_tokens: int) -> dict:
        choice: dict = {"index": 0, "finish_reason": FINISH.get(resp.finish_reason, "stop"), "logprobs": None}
        if kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": resp.text}
        else:
            choice["text"] = resp.text
        return {"id": f"{prefix}-{resp.session_id}", "object": kind, "created": now(), "model": body.model,
                "choices": [choice], "usage": _usage(prompt_tokens, len(resp.token_ids), resp.stats).model_dump(),
                "system_fingerprint": None}

    async def _stream(self, req, body, kind: str, prefix: str, span: trace.Span) -> StreamingResponse:
        """Open the stream before answering: a refused request is an HTTP error, not an event."""
        chunks = aiter(self.service.generate_stream(req))
        first = await anext(chunks, None)
        if first is None:
            raise APIError(500, "the generation ended without a result", "server_error")
        prompt_tokens = self._prompt_tokens(req)
        events = self._events(first, chunks, body, kind, prefix, prompt_tokens)
        return StreamingResponse(self._finally(events, span), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _finally(self, events: AsyncIterator[str], span: trace.Span) -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        finally:
            self.in_flight -= 1
            span.end()

    async def _events(self, first, chunks, body, kind: str, prefix: str, prompt_tokens: int) -> AsyncIterator[str]:
        sid = f"{prefix}-{first.session_id}"
        obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        created = now()

        def event(choices: list, usage: dict | None = None) -> str:
            out = {"id": sid, "object": obj, "created": created, "model": body.model, "choices": choices}
            if usage is not None or (body.stream_options and body.stream_options.include_usage):
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        def delta(text: str, finish: str | None) -> dict:
            if kind == "chat.completion":
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if kind == "chat.completion":
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None}])
        n_tokens, chunk = 0, first
        try:
            while True:
                n_tokens += len(chunk.token_ids)
                finish = FINISH.get(chunk.finish_reason, "stop") if chunk.finish_reason else None
                if chunk.text or finish:
                    yield event([delta(chunk.text, finish)])
                if finish:
                    if body.stream_options and body.stream_options.include_usage:
                        yield event([], _usage(prompt_tokens, n_tokens, chunk.stats).model_dump())
                    break
                chunk = await anext(chunks, None)
                if chunk is None:
                    break
        except Exception as exc:  # mid-stream: the status is sent already, so an error event
            yield f"data: {json.dumps(api_error(exc).body())}\n\n"
        yield "data: [DONE]\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, stats: generation_pb2.GenerationStats) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 completion_tokens_details=CompletionTokensDetails(
                     accepted_prediction_tokens=stats.accepted_prediction_tokens,
                     rejected_prediction_tokens=stats.rejected_prediction_tokens),
                 specserve=SpeculationUsage(draft_pool=stats.draft_pool, k=stats.k, decision=stats.decision,
                                            rounds=stats.rounds, accepted_tokens=stats.accepted_tokens))


class _Server(uvicorn.Server):
    def capture_signals(self):  # the router's GrpcServer owns SIGTERM/SIGINT
        return contextlib.nullcontext()


async def start_http(app: FastAPI, host: str, port: int) -> tuple[_Server, asyncio.Task, int]:
    """Serve `app` on host:port (0 = a free port) in this event loop; returns the bound port."""
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # whose proto says TCP, and an accepted socket takes the listener's. With Nagle on, an SSE
    # event written while the previous one was unacknowledged waited for the client's delayed ACK
    # (40 ms on Linux) on every kept-alive connection: a stream's events came in bursts (ADR 0028).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=10))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        task.result()  # raises what stopped it
    return server, task, int(sock.getsockname()[1])
