"""The key audit (ADR 0023): every Lua script specserve runs touches only keys it declares in
KEYS, and the keys one call declares share one Redis Cluster slot, so every script runs on a
Redis Cluster as on one Redis (COMMIT takes several rounds' keys: a hash tag's on a Cluster, a
whole step's on one Redis, ADR 0028).

The checker reads each script's `redis.call(...)`s: for a command that takes keys, the key
arguments must be `KEYS[n]` (or `key` from a loop over KEYS); a command it does not know
fails the audit until its key positions are added here. The slot check builds the keys the
callers really pass (the store's, the policy store's) and hashes them as Redis Cluster does
(CRC16 of the hash tag). The checker's own test: yesterday's `touch` (a key built from ARGV)
is caught."""

from __future__ import annotations

import re

import pytest
from redis.crc import key_slot

from specserve.control import controller, policy
from specserve.state import scripts
from specserve.state.store import TAGS, SessionStore, tag_of

# command -> positions of its key arguments (None: every argument; () : none)
KEY_ARGS: dict[str, tuple[int, ...] | None] = {
    "HSET": (0,), "HGET": (0,), "HMGET": (0,), "HGETALL": (0,), "HINCRBY": (0,), "HINCRBYFLOAT": (0,),
    "EXPIRE": (0,), "EXISTS": None, "DEL": None, "LLEN": (0,), "RPUSH": (0,), "SADD": (0,), "SREM": (0,),
    "SISMEMBER": (0,), "SET": (0,), "GET": (0,), "XADD": (0,), "TIME": (), "PUBLISH": (), "TTL": (0,),
}
# a declared key: KEYS[n], KEYS[k + n] or KEYS[j] (a script that takes several sessions' keys,
# five each: COMMIT), or `key` from a loop over KEYS
DECLARED = re.compile(r"KEYS\[(\d+|[a-z]( \+ \d+)?)\]|key")


def _calls(lua: str) -> list[tuple[str, list[str]]]:
    """Every redis.call / redis.pcall: (command, its other arguments as source text)."""
    out = []
    for m in re.finditer(r"redis\.p?call\(", lua):
        depth, i, args, start = 1, m.end(), [], m.end()
        while depth:
            c = lua[i]
            if c in "({":
                depth += 1
            elif c in ")}":
                depth -= 1
            elif c == "," and depth == 1:
                args.append(lua[start:i].strip())
                start = i + 1
            i += 1
        args.append(lua[start:i - 1].strip())
        command = args[0].strip("'\"").upper()
        out.append((command, args[1:]))
    return out


def undeclared(lua: str) -> list[str]:
    """The calls whose key arguments are not declared keys (or whose command is unknown)."""
    bad = []
    for command, args in _calls(lua):
        if command not in KEY_ARGS:
            bad.append(f"{command}: unknown command (add its key positions to KEY_ARGS)")
            continue
        spec = KEY_ARGS[command]
        positions = range(len(args)) if spec is None else spec
        for p in positions:
            if p < len(args) and not DECLARED.fullmatch(args[p]):
                bad.append(f"{command} {args[p]}")
    return bad


SCRIPTS = {name: getattr(scripts, name) for name in dir(scripts) if name.isupper() and isinstance(
    getattr(scripts, name), str)}
SCRIPTS |= {"policy._WRITE": policy._WRITE, "controller._ADD": controller._ADD}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_touches_only_declared_keys(name):
    assert _calls(SCRIPTS[name]), f"{name}: no redis.call found (the checker would pass anything)"
    assert undeclared(SCRIPTS[name]) == [], name


def test_the_checker_catches_a_key_built_from_argv():
    before = """
local function touch(request_id)
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[2]) end
  redis.call('EXPIRE', ARGV[1] .. ':running', ARGV[2])
  redis.call('EXPIRE', ARGV[1] .. ':req:' .. request_id, ARGV[2])
end
redis.call('SREM', ARGV[1] .. ':running', string.match(KEYS[1], ':sess:(%x+)$'))
"""
    assert undeclared(before) == ["EXPIRE ARGV[1] .. ':running'", "EXPIRE ARGV[1] .. ':req:' .. request_id",
                                  "SREM ARGV[1] .. ':running'"]
    assert undeclared("redis.call('ZADD', KEYS[1], 1, 'a')") == [
        "ZADD: unknown command (add its key positions to KEY_ARGS)"]


class _NoRedis:
    def register_script(self, _):
        return None


@pytest.mark.parametrize("prefix", ["specserve", "tenant-a:specserve"])
def test_a_sessions_keys_share_one_slot(prefix):
    store = SessionStore(_NoRedis(), prefix=prefix)  # (only its key names are used)
    tags = set()
    for sid in ([store._session_id_for(None) for _ in range(64)]
                + [store._session_id_for(f"req-{i}") for i in range(64)]):
        keys = store._keys(sid) + [f"{prefix}:claim:{{{tag_of(sid)}}}{sid}"]
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
        assert all(k.startswith(prefix + ":") for k in keys)
        tags.add(tag_of(sid))
    assert len(store.running_keys) == TAGS and len(set(store.running_keys)) == TAGS
    assert len(tags) > 40  # the sessions spread over the tags (128 ids over 256 tags)
    # a request id names its session: the same id for the same request, under this prefix only
    assert store._session_id_for("req-1") == store._session_id_for("req-1")
    assert store._session_id_for("req-1") != SessionStore(_NoRedis(), prefix=prefix + "x")._session_id_for("req-1")


def test_the_policy_writes_keys_share_one_slot():
    store = policy.PolicyStore(_NoRedis(), prefix="specserve")
    keys = [store.key("code"), store.audit_key, store.index_key]
    assert len({key_slot(k.encode()) for k in keys}) == 1, keys
