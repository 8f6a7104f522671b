"""Chat messages -> one prompt string, by the model's own chat template: the Jinja
`chat_template` of its tokenizer_config.json (what transformers' apply_chat_template renders,
here without transformers: the router has no torch), or, for a pair built before
`specserve models build` wrote one, the same CHAT_TEMPLATE that the build writes."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import InvalidRequest

# The template `specserve models build` writes for its pairs (trained on plain text, not on
# chat turns: a transcript of turns, ending with the assistant's cue).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise(message: str):
    raise TemplateError(message)


def _token(value) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value or ""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source
        self.template = env.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def for_model(cls, model_dir: str) -> ChatTemplate:
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        jinja = Path(model_dir) / "chat_template.jinja"
        if not source and jinja.exists():
            source = jinja.read_text()
        return cls(source or CHAT_TEMPLATE, _token(config.get("bos_token")), _token(config.get("eos_token")))

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except TemplateError as exc:
            raise InvalidRequest(f"the model's chat template refused these messages: {exc}") from exc
