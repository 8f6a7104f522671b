"""The router's OpenAI-compatible HTTP API through a client nobody here wrote: the official
`openai` SDK against the shared local stack (conftest's `stack`). Greedy results equal the
gRPC result for the same request; usage adds up; Predicted Outputs change nothing in the
output and report what they drafted; errors come back as the SDK's typed exceptions."""

from __future__ import annotations

import time

import grpc
import openai
import pytest

from specserve.serving.chat import ChatTemplate
from specserve.v1 import generation_pb2, generation_pb2_grpc

MAX_TOKENS = 16
MODEL = "specserve"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.info.http}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def grpc_generate(stack):
    channel = grpc.insecure_channel(stack.info.router)
    stub = generation_pb2_grpc.GenerationStub(channel)

    def generate(prompt: str, **kw) -> generation_pb2.GenerateResponse:
        kw.setdefault("draft_pool", "ngram")
        return stub.Generate(generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, **kw), timeout=300)

    yield generate
    channel.close()


@pytest.fixture(scope="module")
def prompt(eval_prompts) -> str:
    return next(p["prompt"] for p in eval_prompts if p["workload_class"] == "code")


def _count(demo_pair, text: str) -> int:
    return len(demo_pair.tokenizer.encode(text, add_special_tokens=False))


def test_completion_equals_grpc_and_usage_adds_up(client, grpc_generate, prompt, demo_pair):
    want = grpc_generate(prompt)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"draft_pool": "ngram", "num_draft_tokens": 4})
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    u = got.usage
    assert u.completion_tokens == len(want.token_ids)
    assert u.prompt_tokens == _count(demo_pair, prompt)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.completion_tokens_details.accepted_prediction_tokens == 0  # no prediction sent
    ext = u.model_extra["specserve"]  # the arm it ran (specserve's extension of usage)
    assert (ext["draft_pool"], ext["k"], ext["decision"]) == ("ngram", 4, "pinned") and ext["rounds"] >= 1


def test_streamed_completion_is_the_same_text(client, grpc_generate, prompt):
    want = grpc_generate(prompt)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"draft_pool": "small"})
    events = list(stream)
    assert "".join(e.choices[0].text for e in events if e.choices) == want.text
    assert events[-1].usage.completion_tokens == len(want.token_ids)
    assert events[-1].usage.model_extra["specserve"]["draft_pool"] == "small"  # the last chunk's stats


def test_chat_equals_grpc_on_the_templated_prompt(client, grpc_generate, demo_pair_dir):
    messages = [{"role": "system", "content": "You answer in Python."},
                {"role": "user", "content": "Write a function that adds two numbers."}]
    want = grpc_generate(ChatTemplate.for_model(str(demo_pair_dir / "target")).render(messages))
    got = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS,
                                         temperature=0, seed=3)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_predicted_outputs_are_lossless_and_counted(client, grpc_generate, demo_pair_dir):
    messages = [{"role": "user", "content": "Return this function unchanged."}]
    templated = ChatTemplate.for_model(str(demo_pair_dir / "target")).render(messages)
    plain = grpc_generate(templated, draft_pool="none")
    edited = plain.text[: len(plain.text) // 2] + " x = 1\n" + plain.text[len(plain.text) // 2 :]
    for prediction in (plain.text, edited):
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                             prediction={"type": "content", "content": prediction})
        assert got.choices[0].message.content == plain.text  # the prediction only drafts
        d = got.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 0
        assert d.accepted_prediction_tokens <= got.usage.completion_tokens
        # the same request over gRPC drafts the same blocks at T = 0
        via_grpc = grpc_generate(templated, draft_pool="", prediction=prediction)
        assert via_grpc.stats.draft_pool == "prediction"
        assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (
            via_grpc.stats.accepted_prediction_tokens, via_grpc.stats.rejected_prediction_tokens)
        if prediction == edited:  # the walk reaches the inserted line, whose tokens the target rejects
            assert d.rejected_prediction_tokens > 0
        else:  # the output itself as the prediction: mostly accepted
            assert d.accepted_prediction_tokens > d.rejected_prediction_tokens
    # /v1/completions takes it too (the SDK sends it there as extra_body)
    got = client.completions.create(model=MODEL, prompt=templated, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"prediction": {"type": "content", "content": plain.text}})
    assert got.choices[0].text == plain.text and got.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_idempotency_key_joins_the_session(client, prompt):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.8,
              extra_headers={"Idempotency-Key": "sdk-retry-1"})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert first.id == again.id and first.choices[0].text == again.choices[0].text


def test_errors_are_typed(client, prompt):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt=prompt, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be in"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=100_000)
    # and the router still serves: the base, and the LoRA adapter the stack loads (ADR 0029)
    assert [m.id for m in client.models.list()] == [MODEL, "records-nested"]


def test_http_requests_are_traced_like_grpc_ones(client, otlp_receiver, prompt):
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"draft_pool": "small"})
    session_id = got.id.removeprefix("cmpl-")
    deadline = time.monotonic() + 30
    while True:  # the router exports its spans in batches every 0.5 s
        spans = otlp_receiver.snapshot()
        gen = [s for s in spans if s["name"] == "specserve.generate"
               and s["attributes"].get("specserve.session_id") == session_id]
        by_id = {s["span_id"]: s for s in spans}
        rounds = [s for s in spans if s["name"] == "specserve.round" and gen and s["trace_id"] == gen[0]["trace_id"]]
        if (gen and gen[0]["parent_span_id"] in by_id and rounds) or time.monotonic() > deadline:
            break  # the target exports the rounds' spans on its own schedule
        time.sleep(0.3)
    assert gen, "no specserve.generate span arrived"
    assert gen[0]["attributes"]["specserve.api"] == "http"
    server = by_id[gen[0]["parent_span_id"]]
    assert (server["name"], server["kind"], server["attributes"]["specserve.api"]) == \
        ("POST /v1/completions", "SERVER", "http")
    assert rounds and all(r["attributes"]["specserve.draft_pool"] == "small" for r in rounds)
