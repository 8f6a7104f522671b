"""What a request may constrain its output to (ADR 0017): a JSON Schema, any JSON object, a
regular expression, an EBNF grammar or a list of choices. Torch-free and xgrammar-free: the
router parses and stores it, the target compiles it (structured/grammar.py).

Example:
    Constraint.json_schema('{"type": "object"}').encode() -> {"kind": "json_schema", "value": '{"type": "object"}'}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from specserve.errors import InvalidRequest

KINDS = ("json_object", "json_schema", "regex", "grammar", "choice", "text")  # text: explicitly free
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema or grammar longer than this is refused (400)


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    value: str = ""  # the schema (JSON text), regex, EBNF, or the choices (a JSON list); "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"the {self.kind} constraint has {len(self.value)} characters; the limit is "
                                 f"{MAX_CONSTRAINT_CHARS}")
        if self.kind not in ("json_object", "text") and not self.value:
            raise InvalidRequest(f"the {self.kind} constraint is empty")

    @classmethod
    def text(cls) -> Constraint:
        """Free text, asked for explicitly (no constraint; a class's default does not apply)."""
        return cls("text")

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> Constraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order is the output order
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidRequest("the JSON schema must be a JSON object")
        return cls("json_schema", text)

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequest("guided_choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    def choices(self) -> list[str]:
        return list(json.loads(self.value)) if self.kind == "choice" else []

    @property
    def key(self) -> str:
        """What compilations are cached by (with the tokenizer)."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()[:32]

    @property
    def stats_suffix(self) -> str:
        """Constrained rounds are counted apart from free text (their acceptance is not
        comparable): the class's statistics go under `<class>+<kind>`."""
        return f"+{self.kind}"

    @classmethod
    def from_proto(cls, msg: Any) -> Constraint | None:
        """A `specserve.v1.Constraint` (None when unset)."""
        which = msg.WhichOneof("kind")
        if which is None or which == "text":
            return None
        if which == "json_object":
            return cls.json_object() if msg.json_object else None
        if which == "json_schema":
            return cls.json_schema(msg.json_schema)
        if which == "choice":
            return cls.choice(list(msg.choice.options))
        return cls(which, getattr(msg, which))

    def to_proto(self, msg: Any) -> None:
        """Fill a `specserve.v1.Constraint`."""
        if self.kind in ("json_object", "text"):
            setattr(msg, self.kind, True)
        elif self.kind == "choice":
            msg.choice.options.extend(self.choices())
        else:
            setattr(msg, self.kind, self.value)

    def encode(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def decode(cls, d: dict[str, Any] | None) -> Constraint | None:
        return cls(str(d["kind"]), str(d.get("value") or "")) if d else None
