"""The OpenAI-compatible HTTP API over a fake GenerationService: how bodies map to the
GenerateRequest, the response and SSE shapes, usage, and every error as an OpenAI error
object with its status. The real servicer is exercised by tests/integration/test_openai_sdk.py."""

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from specserve.errors import AdapterNotFound, InvalidRequest, ResourceExhausted, Unavailable
from specserve.services.router.openai_api import OpenAIApp
from specserve.serving.chat import CHAT_TEMPLATE, ChatTemplate
from specserve.v1 import generation_pb2

MODEL = "specserve"


class FakeTargets:
    """The targets' LoRA adapters (ADR 0029): `sql-v2` is loaded."""

    loaded = {"sql-v2"}

    async def adapters(self, fresh: bool = False) -> set[str]:
        return set(self.loaded)

    async def require_adapter(self, adapter: str) -> None:
        if adapter not in self.loaded:
            raise AdapterNotFound(f"no target has adapter {adapter!r} loaded")


class FakeService:
    """Answers every request with the tokens 7 8 9 ("a", "b", "c"), or raises `fail`; a request
    naming an adapter no target has gets AdapterNotFound, as the service's."""

    def __init__(self) -> None:
        self.settings = SimpleNamespace(max_tokens_limit=64)
        self.sessions = SimpleNamespace(targets=FakeTargets())
        self.model = SimpleNamespace(encode=lambda text: list(range(len(text.split()))))
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.fail: Exception | None = None

    def _stats(self) -> generation_pb2.GenerationStats:
        return generation_pb2.GenerationStats(accepted_prediction_tokens=2, rejected_prediction_tokens=5,
                                              draft_pool="ngram", k=6, decision="pinned", rounds=2, accepted_tokens=1)

    async def generate(self, req):
        self.requests.append(req)
        if req.adapter:
            await self.sessions.targets.require_adapter(req.adapter)
        if self.fail:
            raise self.fail
        return generation_pb2.GenerateResponse(session_id="s1", text="abc", token_ids=[7, 8, 9],
                                               finish_reason="length", stats=self._stats())

    async def generate_stream(self, req):
        self.requests.append(req)
        if self.fail:
            raise self.fail
        yield generation_pb2.GenerateChunk(session_id="s1", offset=0, token_ids=[7, 8], text="ab")
        yield generation_pb2.GenerateChunk(session_id="s1", offset=2, token_ids=[9], text="c", finish_reason="eos",
                                           stats=self._stats())


def make(api_keys=(), ready=True, max_in_flight=8):
    fake = FakeService()
    api = OpenAIApp(fake, MODEL, ChatTemplate(CHAT_TEMPLATE), set(api_keys), max_in_flight, lambda: ready)
    return fake, api, TestClient(api.app)


def sse(resp) -> list:
    lines = [ln.removeprefix("data: ") for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_completion_maps_the_body_and_reports_usage():
    fake, _, client = make()
    r = client.post("/v1/completions", headers={"Idempotency-Key": "retry-1"}, json={
        "model": MODEL, "prompt": "one two three", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 11,
        "stop": ["\n"], "user": "u1", "workload_class": "code", "draft_pool": "ngram", "num_draft_tokens": 6,
        "prediction": {"type": "content", "content": "one two"}})
    assert r.status_code == 200, r.text
    req = fake.requests[0]
    assert (req.prompt, req.max_tokens, req.temperature, req.seed, list(req.stop)) == ("one two three", 3, 0.5, 11,
                                                                                         ["\n"])
    assert req.top_p == pytest.approx(0.9)
    assert (req.workload_class, req.draft_pool, req.num_draft_tokens) == ("code", "ngram", 6)
    assert (req.request_id, req.prediction) == ("retry-1", "one two")
    body = r.json()
    assert body["object"] == "text_completion" and body["id"] == "cmpl-s1"
    assert body["choices"] == [{"index": 0, "text": "abc", "finish_reason": "length", "logprobs": None}]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 6
    assert body["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 2
    assert body["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] == 5
    # specserve's extension: the arm the request ran, as GenerationStats gives it over gRPC
    assert body["usage"]["specserve"] == {"draft_pool": "ngram", "k": 6, "decision": "pinned", "rounds": 2,
                                          "accepted_tokens": 1}


def test_completion_defaults_and_token_prompt():
    fake, _, client = make()
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6]}).status_code == 200
    req = fake.requests[0]
    assert list(req.prompt_ids.ids) == [5, 6]
    assert req.max_tokens == 16 and req.temperature == 1.0  # OpenAI's defaults
    assert not req.HasField("top_p") and not req.HasField("seed") and not req.HasField("num_draft_tokens")


def test_chat_renders_the_template_and_max_completion_tokens_wins():
    fake, _, client = make()
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 9, "max_completion_tokens": 4,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200, r.text
    assert fake.requests[0].prompt == "System: be brief\nUser: hi\nAssistant:"
    assert fake.requests[0].max_tokens == 4
    choice = r.json()["choices"][0]
    assert r.json()["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": "abc"} and choice["finish_reason"] == "length"


def test_chat_stream_sends_role_deltas_finish_usage_then_done():
    _, _, client = make()
    r = client.post("/v1/chat/completions", json={"model": MODEL, "stream": True,
                                                  "stream_options": {"include_usage": True},
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "abc"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"  # eos -> stop
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert events[-1]["usage"]["specserve"]["draft_pool"] == "ngram"  # the last chunk's stats
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == "chatcmpl-s1" for e in events)


def test_completion_stream_without_usage():
    _, _, client = make()
    events = sse(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == "abc"
    assert all("usage" not in e for e in events)


@pytest.mark.parametrize("body,param", [
    ({"n": 2}, "n"), ({"temperature": 3}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"top_p": 0}, "top_p"),
])
def test_invalid_body_is_a_400_error_object(body, param):
    fake, _, client = make()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]
    assert not fake.requests  # refused before reaching the servicer


def test_missing_field_names_it():
    _, _, client = make()
    r = client.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_unknown_model_is_404():
    _, _, client = make()
    r = client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/models/gpt-4o").status_code == 404


@pytest.mark.parametrize("exc,status", [(InvalidRequest("max_tokens must be in [1, 64], got 99"), 400),
                                        (Unavailable("no target worker is registered; retry later"), 503),
                                        (ResourceExhausted("no target had KV room for 2.0 s"), 429)])
def test_domain_errors_keep_their_message(exc, status):
    fake, _, client = make()
    fake.fail = exc
    for stream in (False, True):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
        assert r.status_code == status and str(exc) in r.json()["error"]["message"]


def test_api_keys_are_checked_when_configured():
    _, _, client = make(api_keys={"k1"})
    body = {"model": MODEL, "prompt": "x"}
    missing = client.post("/v1/completions", json=body)
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
    wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k1"}).status_code == 200
    assert client.get("/health").status_code == 200  # probes carry no key


def test_saturated_router_answers_429():
    _, api, client = make(max_in_flight=1)
    api.in_flight = 1  # one request in flight already
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_the_model_field_names_a_lora_adapter():
    """ADR 0029, as vLLM: `model` is the base's name or a loaded adapter's (echoed back)."""
    fake, _, client = make()
    r = client.post("/v1/completions", json={"model": "sql-v2", "prompt": "x"})
    assert r.status_code == 200 and r.json()["model"] == "sql-v2" and fake.requests[-1].adapter == "sql-v2"
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert fake.requests[-1].adapter == ""
    r = client.post("/v1/chat/completions", json={"model": "Not An Adapter!", "messages": [{"role": "user",
                                                                                           "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    card = client.get("/v1/models/sql-v2").json()
    assert card["id"] == "sql-v2" and card["parent"] == MODEL


def test_models_and_health():
    _, _, client = make()
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL, "sql-v2"]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/health").json() == {"status": "ok"}
    _, _, starting = make(ready=False)
    assert starting.get("/health").status_code == 503


def test_hf_chat_template_from_tokenizer_config(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    chat = ChatTemplate.for_model(str(tmp_path))
    assert chat.render([{"role": "user", "content": "hi"}]) == "<s><|user|>hi</s><|assistant|>"


def test_pair_without_template_gets_the_built_one(tmp_path):
    assert ChatTemplate.for_model(str(tmp_path)).source == CHAT_TEMPLATE


def test_template_refusal_is_invalid_request():
    chat = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        chat.render([{"role": "user", "content": "hi"}])


def test_http_requests_are_counted_by_route_and_status():
    from specserve.serving.metrics import RouterMetrics

    metrics = RouterMetrics()
    api = OpenAIApp(FakeService(), MODEL, ChatTemplate(CHAT_TEMPLATE), set(), 8, lambda: True, metrics)
    client = TestClient(api.app)
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"})  # refused before serving
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2})  # the body's validation
    api.service.fail = Unavailable("no target")
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})

    def count(status: str) -> float | None:
        return metrics.registry.get_sample_value("specserve_api_requests_total",
                                                 {"api": "http", "route": "/v1/completions", "status": status})

    # a stream counts as served; a refusal counts whichever layer refused it
    assert (count("200"), count("404"), count("400"), count("503")) == (2.0, 1.0, 1.0, 1.0)


def test_the_http_servers_connections_send_without_nagles_delay():
    """Every connection the HTTP API accepts has Nagle's algorithm off (TCP_NODELAY): with it on,
    an SSE event written while the previous one was unacknowledged waited for the client's
    delayed ACK, 40 ms on a kept-alive connection, so a stream's tokens came in bursts. asyncio
    sets TCP_NODELAY only where the socket's proto says TCP; the listener used to say 0."""
    import asyncio
    import socket

    from fastapi import FastAPI

    from specserve.services.router.openai_api import start_http

    async def body() -> list[int]:
        server, task, port = await start_http(FastAPI(), "127.0.0.1", 0)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if server.server_state.connections:
                    break
                await asyncio.sleep(0.01)
            socks = [c.transport.get_extra_info("socket") for c in server.server_state.connections]
            writer.close()
            return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks]
        finally:
            server.should_exit = True
            await task

    assert asyncio.run(body()) == [1]
