"""The OpenAI HTTP API's request and response bodies (the subset specserve serves), as
pydantic models: a request is validated here once, then converted to a GenerateRequest, the
same typed path a gRPC request takes. Unknown fields are ignored, as OpenAI's server does."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specserve.errors import InvalidRequest
from specserve.structured.constraint import Constraint


class Prediction(BaseModel):
    """Predicted Outputs: the text the output is expected to mostly repeat."""

    type: Literal["content"] = "content"
    content: str | list[dict] = ""

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # always enforced: the output matches the schema


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or a JSON Schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prediction: Prediction | None = None
    # specserve extensions (the openai SDK sends them with extra_body=...)
    workload_class: str = ""
    draft_pool: str = ""
    num_draft_tokens: int | None = Field(None, ge=0, le=32)
    top_k: int = Field(0, ge=0)
    # structured output (ADR 0017): OpenAI's response_format, or vLLM's guided_* (extra_body)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n must be 1 (specserve returns one choice per request), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def constraint(self) -> Constraint | None:
        """The one constraint the request names (InvalidRequest for two, or a bad one)."""
        found: list[Constraint] = []
        rf = self.response_format
        if rf is not None and rf.type == "text":
            found.append(Constraint.text())
        elif rf is not None and rf.type == "json_object":
            found.append(Constraint.json_object())
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequest("response_format json_schema needs json_schema.schema")
            found.append(Constraint.json_schema(rf.json_schema.schema_))
        if self.guided_json is not None:
            found.append(Constraint.json_schema(self.guided_json))
        if self.guided_regex is not None:
            found.append(Constraint("regex", self.guided_regex))
        if self.guided_grammar is not None:
            found.append(Constraint("grammar", self.guided_grammar))
        if self.guided_choice is not None:
            found.append(Constraint.choice(self.guided_choice))
        if len(found) > 1:
            raise InvalidRequest("name one constraint: response_format, guided_json, guided_regex, guided_grammar "
                                 "or guided_choice")
        return found[0] if found else None

    def budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError(f"prompt takes one string (a batch of {len(v)} is not served); send one "
                             "request per prompt")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type", "text") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


# -- responses ----------------------------------------------------------------------------
class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0


class SpeculationUsage(BaseModel):
    """A specserve extension of `usage`: the arm the request ran (its plan's draft pool, K and
    the controller's decision, as GenerationStats gives them over gRPC) and what it did.
    Clients that read only OpenAI's fields ignore it."""

    draft_pool: str = ""
    k: int = 0
    decision: str = ""
    rounds: int = 0
    accepted_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)
    specserve: SpeculationUsage = Field(default_factory=SpeculationUsage)


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specserve"
    root: str | None = None  # a LoRA adapter's base model (ADR 0029, as vLLM lists them)
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
