"""The fleet's LoRA adapters in Redis (ADR 0029): a hash `{prefix}:adapters` of name -> path,
written by the routers' AdapterAdmin after every live target loaded the adapter, read by a
target at its start so that one started or restarted later serves them too."""

from __future__ import annotations

from typing import Any


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class AdapterRegistry:
    def __init__(self, redis: Any, prefix: str) -> None:
        self.redis, self.key = redis, f"{prefix}:adapters"

    async def all(self) -> dict[str, str]:
        return {_text(k): _text(v) for k, v in (await self.redis.hgetall(self.key)).items()}

    async def add(self, name: str, path: str) -> None:
        await self.redis.hset(self.key, name, path)

    async def remove(self, name: str) -> bool:
        return bool(await self.redis.hdel(self.key, name))
