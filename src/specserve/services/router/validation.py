"""GenerateRequest -> a typed, validated request (TGI's ValidGenerateRequest): everything
downstream reads typed fields. Every refusal is INVALID_ARGUMENT with a message a person can
act on."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.control.arms import NO_SPECULATION, RequestFacts
from specserve.control.policy import ADAPTER_NAME, CLASS_NAME
from specserve.drafters.prediction import PREDICTION_POOL, check_prediction
from specserve.errors import InvalidRequest
from specserve.model_info import ModelInfo
from specserve.params import GenerationParams, SamplingParams, check_k
from specserve.services.router.classifier import Classifier
from specserve.structured.constraint import Constraint
from specserve.v1 import generation_pb2


@dataclass(frozen=True)
class ValidRequest:
    prompt_ids: list[int]
    prompt_text: str
    params: GenerationParams  # num_draft_tokens is settled by the arm choice (planner)
    workload_class: str
    class_reason: str
    pinned_pool: str | None  # the request's own draft_pool ("none" = no speculation), or None
    pinned_k: int | None  # the request's own num_draft_tokens, or None
    request_id: str | None
    prediction_ids: tuple[int, ...] = ()  # Predicted Outputs: the expected output, tokenized
    constraint: Constraint | None = None  # structured output (ADR 0017), compiled once here to check it
    free_text: bool = False  # the request asked for free text: the class's default output does not apply
    adapter: str = ""  # the LoRA adapter it runs on (ADR 0029; "" = the base)

    @property
    def facts(self) -> RequestFacts:
        """What the arm choice needs to know of the request."""
        return RequestFacts(self.params.sampling.temperature, len(self.prompt_ids), self.pinned_pool, self.pinned_k,
                            seeded=self.params.seed is not None, request_id=self.request_id)


def parse(req: generation_pb2.GenerateRequest, model: ModelInfo, pools: list[str], classifier: Classifier,
          max_tokens_limit: int, max_prompt_tokens: int) -> ValidRequest:
    which = req.WhichOneof("input")
    if which == "prompt_ids":
        ids = [int(t) for t in req.prompt_ids.ids]
        bad = [t for t in ids if t >= model.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary (size {model.vocab_size})")
        text = model.decode(ids)
    else:
        text = req.prompt
        ids = model.encode(text) if text else []
    if not ids:
        raise InvalidRequest("the prompt is empty: send prompt text or prompt_ids")
    if len(ids) > max_prompt_tokens:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; the limit is {max_prompt_tokens}")
    if req.max_tokens < 1 or req.max_tokens > max_tokens_limit:
        raise InvalidRequest(f"max_tokens must be in [1, {max_tokens_limit}], got {req.max_tokens}")
    if len(ids) + req.max_tokens > model.context_len:
        raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                             f"context length of {model.context_len}")
    if req.workload_class and not CLASS_NAME.match(req.workload_class):
        raise InvalidRequest(f"invalid workload_class {req.workload_class!r}: lower-case letters, digits, '_' or "
                             "'-', starting with a letter (at most 64); or leave it empty to classify the prompt")
    cls, reason = (req.workload_class, "explicit") if req.workload_class else classifier.classify(text)
    prediction = tuple(model.encode(req.prediction)) if req.prediction else ()
    pinned_pool = req.draft_pool or None
    check_prediction(prediction, pinned_pool, model.context_len)
    if pinned_pool is not None and pinned_pool not in (NO_SPECULATION, PREDICTION_POOL, *pools):
        raise InvalidRequest(f"unknown draft_pool {pinned_pool!r}; available: {', '.join(sorted(pools))}, "
                             f"{PREDICTION_POOL!r} (with a prediction) or {NO_SPECULATION!r}")
    pinned_k = int(req.num_draft_tokens) if req.HasField("num_draft_tokens") else None
    if pinned_k is not None:
        check_k(pinned_k)
    if len(req.request_id) > 256:
        raise InvalidRequest("request_id is longer than 256 characters")
    sampling = SamplingParams(
        temperature=float(req.temperature), top_k=int(req.top_k),
        top_p=float(req.top_p) if req.HasField("top_p") else 1.0,
        banned_token_ids=tuple(int(t) for t in req.banned_token_ids))
    sampling.check_vocab(model.vocab_size)
    params = GenerationParams(
        max_tokens=int(req.max_tokens), sampling=sampling, num_draft_tokens=0,
        stop=tuple(req.stop), seed=int(req.seed) if req.HasField("seed") else None)
    if req.adapter and not ADAPTER_NAME.match(req.adapter):
        raise InvalidRequest(f"invalid adapter {req.adapter!r}: lower-case letters, digits, '.', '_' or '-' (at most "
                             "64), or leave it empty for the base model")
    constraint = Constraint.from_proto(req.constraint) if req.HasField("constraint") else None
    if constraint is not None:
        model.grammars().compile(constraint)  # InvalidRequest with the compiler's message
    return ValidRequest(ids, text, params, cls, reason, pinned_pool, pinned_k, req.request_id or None, prediction,
                        constraint, req.HasField("constraint") and req.constraint.WhichOneof("kind") == "text",
                        adapter=req.adapter)
