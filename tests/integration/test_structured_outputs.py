"""Structured outputs through the local stack (ADR 0017): the `openai` SDK's response_format
and vLLM's guided_* extras against the router's HTTP API, and the gRPC `constraint`; the
target's engine masks every round; a bad constraint is refused before a session exists."""

from __future__ import annotations

import json
import re

import grpc
import openai
import pytest

from specserve.v1 import generation_pb2, generation_pb2_grpc

pytest.importorskip("xgrammar")

MODEL = "specserve"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"},
                         "coastal": {"type": "boolean"}},
          "required": ["city", "population", "coastal"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.info.http}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stub(stack):
    channel = grpc.insecure_channel(stack.info.router)
    yield generation_pb2_grpc.GenerationStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def extraction_prompt(eval_prompts) -> str:
    return next(p["prompt"] for p in eval_prompts if p["workload_class"] == "extraction")


@pytest.mark.parametrize("pool", ["small", "ngram", "none"])
def test_response_format_json_schema_parses_and_matches(client, extraction_prompt, pool):
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": extraction_prompt}], max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}},
        extra_body={"draft_pool": pool})
    choice = got.choices[0]
    # greedy on this prompt, the demo pair closes the object in 47 tokens (a truncated one would
    # say finish_reason "length" and need not parse)
    assert choice.finish_reason == "stop", choice.message.content
    obj = json.loads(choice.message.content)
    assert set(obj) == {"city", "population", "coastal"}
    assert isinstance(obj["population"], int) and isinstance(obj["coastal"], bool) and len(obj["city"]) <= 20


def test_greedy_constrained_output_is_the_same_with_and_without_speculation(client, extraction_prompt):
    texts = set()
    for pool in ("small", "ngram", "none"):
        got = client.completions.create(model=MODEL, prompt=extraction_prompt, max_tokens=64, temperature=0,
                                        extra_body={"draft_pool": pool, "guided_json": SCHEMA})
        texts.add(got.choices[0].text)
    assert len(texts) == 1, texts


def test_json_object_regex_and_choice(client, extraction_prompt):
    got = client.completions.create(model=MODEL, prompt=extraction_prompt, max_tokens=64, temperature=0.7, seed=3,
                                    extra_body={"response_format": {"type": "json_object"}})
    if got.choices[0].finish_reason != "length":
        assert isinstance(json.loads(got.choices[0].text), dict)
    got = client.completions.create(model=MODEL, prompt="Call me at ", max_tokens=16, temperature=0.8, seed=5,
                                    extra_body={"guided_regex": r"\d{3}-\d{4}", "draft_pool": "small"})
    assert re.fullmatch(r"\d{3}-\d{4}", got.choices[0].text), got.choices[0].text
    colours = ["red", "green", "blue"]
    got = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8, temperature=1.0,
                                    extra_body={"guided_choice": colours, "draft_pool": "ngram"})
    assert got.choices[0].text in colours and got.choices[0].finish_reason == "stop"


def test_grpc_constraint_and_its_statistics_class(stub, extraction_prompt):
    req = generation_pb2.GenerateRequest(prompt=extraction_prompt, max_tokens=48, draft_pool="small",
                                         workload_class="extraction",
                                         constraint=generation_pb2.Constraint(json_schema=json.dumps(SCHEMA)))
    r = stub.Generate(req, timeout=300)
    if r.finish_reason != "length":
        json.loads(r.text)
    assert r.stats.workload_class == "extraction"
    assert sum(x.emitted for x in r.stats.round) == len(r.token_ids)


@pytest.mark.parametrize(("extra", "message"), [
    ({"guided_regex": "(ab"}, "regex constraint does not compile"),
    ({"guided_grammar": "root ::= missing"}, "grammar constraint does not compile"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "name one constraint"),
])
def test_a_bad_constraint_is_a_400_with_the_compilers_message(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)


def test_a_bad_grpc_constraint_is_invalid_argument_and_the_router_lives_on(stub):
    bad = generation_pb2.GenerateRequest(prompt="x", max_tokens=4,
                                         constraint=generation_pb2.Constraint(grammar="root ::= ("))
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(bad, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not compile" in err.value.details()
    ok = stub.Generate(generation_pb2.GenerateRequest(prompt="x", max_tokens=4), timeout=300)
    assert len(ok.token_ids) >= 1
