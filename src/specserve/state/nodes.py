"""A Redis Cluster's nodes as plain clients, for what redis-py's cluster client cannot do
(ADR 0023): pipelines of scripts (its cluster pipeline refuses EVALSHA) and a `WAIT` on the
node that holds a session (state/reading.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from specserve.state.connection import evalsha_pipeline

# the cluster client's connection settings a node's plain client takes over
_KEEP = ("host", "port", "password", "username", "decode_responses", "encoding", "socket_timeout",
         "socket_connect_timeout", "socket_keepalive", "protocol")


class ClusterNodes:
    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self._clients: dict[tuple[str, int], Redis] = {}

    def client_for(self, key: str) -> Redis:
        """A plain client to the node that owns `key`'s slot, as far as the cluster client
        knows (it learns of a move or a failover when one of its own commands meets it)."""
        node = self.cluster.get_node_from_key(key)
        return self._client((node.host, node.port))

    def _client(self, address: tuple[str, int]) -> Redis:
        client = self._clients.get(address)
        if client is None:
            kwargs = dict(self.cluster.get_nodes()[0].connection_kwargs)
            kwargs.update(host=address[0], port=address[1])
            client = self._clients[address] = Redis(**{k: v for k, v in kwargs.items() if k in _KEEP})
        return client

    async def scripts(self, calls: Sequence[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """Script calls (script, keys, args), answered in order, as one pipeline
        per node: grouped by the node that owns their keys' slot, so a session's calls keep
        their order. A node's pipeline that fails (its slots moved, the node died) is redone
        call by call on the cluster client, which follows redirections and rides out an
        election: safe, as each call is idempotent (a commit by its round id, a heartbeat,
        the stats)."""
        by_node: dict[tuple[str, int], list[int]] = {}
        for i, (_, keys, _) in enumerate(calls):
            node = self.cluster.get_node_from_key(keys[0])
            by_node.setdefault((node.host, node.port), []).append(i)
        out: list[Any] = [None] * len(calls)

        async def on_node(address: tuple[str, int], indices: list[int]) -> None:
            try:
                replies = await evalsha_pipeline(self._client(address), [calls[i] for i in indices])
                for i, reply in zip(indices, replies, strict=True):
                    out[i] = reply
            except Exception:
                for i in indices:  # one by one on the cluster client (redirections, elections)
                    script, keys, args = calls[i]
                    out[i] = await script(keys=keys, args=args)

        await asyncio.gather(*(on_node(a, ix) for a, ix in by_node.items()))
        return out

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()
