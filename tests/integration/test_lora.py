"""LoRA adapters through the stack (ADR 0029), against PEFT's merged models in transformers.

The shared stack (conftest's `stack`) loads the pair's demo adapter `records-nested` at start
(SPECSERVE_TARGET_ADAPTERS) and runs its drafter, the draft with the adapter's draft-side LoRA
merged, as pool `small-records`. Here:
- greedy output per adapter, through the router over gRPC and over the OpenAI API (`model`),
  speculation off and on with the base draft, the adapter's own drafter and n-gram lookup, is
  exactly PEFT's merged model's greedy continuation (transformers' `generate`); a second adapter
  loaded at run time (one PEFT made) too;
- an adapter no target has is NOT_FOUND over gRPC and 404 `model_not_found` over HTTP, before a
  session is created; `/v1/models` lists the loaded adapters;
- under traffic of the base and of the demo adapter, an adapter is loaded, served, unloaded, and
  three bad ones (a corrupt file, another base, a rank over the limit) are refused with their
  reasons: no request of another adapter fails or changes its tokens.
"""

from __future__ import annotations

import copy
import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from specserve.v1 import adapter_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2

peft = pytest.importorskip("peft")

ADAPTER = "records-nested"
MAX_TOKENS = 32
TOKEN = "lora-admin"
AUTH = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.info.router) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def admin(channel):
    return adapter_pb2_grpc.AdapterAdminStub(channel)


@pytest.fixture(scope="module")
def adapter_prompts(demo_pair_dir) -> list[str]:
    held = json.loads((demo_pair_dir / "adapters" / ADAPTER / "eval_prompts.json").read_text())["prompts"]
    return [p["prompt"] for p in held[:3]]


def _merged(demo_pair, path):
    return peft.PeftModel.from_pretrained(copy.deepcopy(demo_pair.target), str(path)).merge_and_unload().eval()


def _reference(model, demo_pair):
    cache: dict[str, list[int]] = {}

    @torch.no_grad()
    def ref(prompt: str) -> list[int]:
        if prompt not in cache:
            ids = demo_pair.tokenizer.encode(prompt)
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
            eos = demo_pair.target.generation_config.eos_token_id
            cache[prompt] = out[:out.index(eos)] if eos in out else out  # (the served output stops at EOS)
        return cache[prompt]

    return ref


@pytest.fixture(scope="module")
def adapter_reference(demo_pair, demo_pair_dir):
    """PEFT's merged model of the demo adapter: its greedy continuation of a prompt."""
    return _reference(_merged(demo_pair, demo_pair_dir / "adapters" / ADAPTER / "target"), demo_pair)


def _req(prompt: str, **kw) -> generation_pb2.GenerateRequest:
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("workload_class", "extraction")
    return generation_pb2.GenerateRequest(prompt=prompt, **kw)


@pytest.mark.parametrize("pool", ["none", "small", "small-records", "ngram-local"])
def test_greedy_with_the_adapter_through_the_router_is_peft_merged_models(stub, adapter_prompts, adapter_reference,
                                                                          pool):
    drafted = 0
    for prompt in adapter_prompts:
        resp = stub.Generate(_req(prompt, adapter=ADAPTER, draft_pool=pool), timeout=300)
        assert list(resp.token_ids) == adapter_reference(prompt), (pool, prompt[-60:])
        drafted += resp.stats.draft_tokens
    assert (drafted > 0) == (pool != "none")


def test_the_openai_model_field_names_the_adapter(stack, stub, adapter_prompts, adapter_reference):
    prompt = adapter_prompts[0]
    body = {"model": ADAPTER, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "workload_class": "extraction", "draft_pool": "small-records"}
    got = _post(stack, "/v1/completions", body)
    want = stub.Generate(_req(prompt, adapter=ADAPTER, draft_pool="none"), timeout=300)
    assert got["choices"][0]["text"] == want.text and got["model"] == ADAPTER
    assert list(want.token_ids) == adapter_reference(prompt)
    models = json.loads(urllib.request.urlopen(f"{stack.info.http}/v1/models", timeout=30).read())
    assert {m["id"] for m in models["data"]} >= {"specserve", ADAPTER}
    assert next(m for m in models["data"] if m["id"] == ADAPTER)["parent"] == "specserve"


def test_an_unknown_adapter_is_not_found(stack, stub, adapter_prompts):
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_req(adapter_prompts[0], adapter="no-such-adapter"), timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-adapter" in err.value.details()
    with pytest.raises(urllib.error.HTTPError) as http:
        _post(stack, "/v1/completions", {"model": "no-such-adapter", "prompt": "x", "max_tokens": 4})
    assert http.value.code == 404 and json.loads(http.value.read())["error"]["code"] == "model_not_found"


def _post(stack, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{stack.info.http}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


class Traffic:
    """Requests of the base and of the demo adapter in a loop on two threads until stopped;
    every answer is checked against its reference, every failure kept."""

    def __init__(self, stub, jobs: list[tuple[str, str, list[int]]]) -> None:
        self.stub, self.jobs = stub, jobs
        self.stop = threading.Event()
        self.done, self.failures = 0, []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(2)]

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            prompt, adapter, want = self.jobs[(self.done + i) % len(self.jobs)]
            try:
                resp = self.stub.Generate(_req(prompt, adapter=adapter, draft_pool="small"), timeout=300)
                if list(resp.token_ids) != want:
                    self.failures.append(f"{adapter or 'base'}: other tokens")
            except grpc.RpcError as err:
                self.failures.append(f"{adapter or 'base'}: {err.code().name} {err.details()}")
            self.done += 1

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)


def test_load_unload_and_refuse_at_run_time_under_traffic(stub, admin, demo_pair, demo_pair_dir, adapter_prompts,
                                                          adapter_reference, reference_base, tmp_path):
    torch.manual_seed(1)
    extra = peft.get_peft_model(copy.deepcopy(demo_pair.target), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    extra.save_pretrained(tmp_path / "extra")
    extra_reference = _reference(extra.merge_and_unload().eval(), demo_pair)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in (tmp_path / "extra").iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    other = peft.get_peft_model(copy.deepcopy(demo_pair.draft), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    other.save_pretrained(tmp_path / "draft-lora")
    big = peft.get_peft_model(copy.deepcopy(demo_pair.target), peft.LoraConfig(r=64, target_modules=["q_proj"]))
    big.save_pretrained(tmp_path / "big")
    jobs = [(p, ADAPTER, adapter_reference(p)) for p in adapter_prompts[:2]] + \
           [(p, "", reference_base(p)) for p in adapter_prompts[:2]]
    prompt = adapter_prompts[2]
    with Traffic(stub, jobs) as traffic:
        for path, reason in ((corrupt, "not a readable safetensors file"), (tmp_path / "draft-lora", "another base"),
                             (tmp_path / "big", "max LoRA rank")):
            with pytest.raises(grpc.RpcError) as err:
                admin.LoadAdapter(target_pb2.LoadAdapterRequest(name="bad", path=str(path)), metadata=AUTH,
                                  timeout=120)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()
        fleet = admin.LoadAdapter(target_pb2.LoadAdapterRequest(name="extra", path=str(tmp_path / "extra")),
                                  metadata=AUTH, timeout=120)
        assert {a.name for a in fleet.adapters} == {ADAPTER, "extra"} and fleet.registered["extra"]
        for pool in ("none", "small"):
            resp = stub.Generate(_req(prompt, adapter="extra", draft_pool=pool), timeout=300)
            assert list(resp.token_ids) == extra_reference(prompt), pool
        fleet = admin.UnloadAdapter(target_pb2.UnloadAdapterRequest(name="extra"), metadata=AUTH, timeout=120)
        assert {a.name for a in fleet.adapters} == {ADAPTER} and "extra" not in fleet.registered
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(_req(prompt, adapter="extra"), timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        while traffic.done < 8 and not traffic.failures:
            traffic.stop.wait(0.5)
    assert traffic.failures == [] and traffic.done >= 8
    listed = admin.ListAdapters(target_pb2.ListAdaptersRequest(), metadata=AUTH, timeout=60)
    assert [a.name for a in listed.adapters] == [ADAPTER]


@pytest.fixture(scope="module")
def reference_base(demo_pair):
    return _reference(demo_pair.target, demo_pair)
