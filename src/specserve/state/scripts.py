"""The store's Lua scripts: each one atomic on the Redis node, and fenced where it writes a
session (expected length, epoch, round id; state/store.py says what each key holds).

Cluster-safe (ADR 0023): a script touches only the keys it is given in KEYS, and those all
carry the session's hash tag, so they live in one slot (`tests/unit/test_store_keys.py`
checks both for every script)."""

_LUA_HELPERS = """
local function now()
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', t[2])
end
local function later(seconds)
  local t = redis.call('TIME')
  return string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(seconds))
end
local function touch()
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[2]) end
end
local function session_id()
  return string.match(KEYS[1], '(%x+)$')
end
"""

# KEYS: hash, tok, out, rounds, running. ARGV[3..8]: session_id, params, prompt_ids, owner,
# request_id, lease_s. A request id names its session (the store derives the id from it), so
# a retry finds the hash: it joins it (or conflicts, with another prompt). Atomic, so two at
# once make one. A new session clears what an expired one of the same id may have left.
CREATE = (
    _LUA_HELPERS
    + """
if ARGV[7] ~= '' then
  local h = redis.call('HMGET', KEYS[1], 'prompt_ids', 'epoch')
  if h[1] then
    if h[1] ~= ARGV[5] then return {'conflict', ARGV[3], 0} end
    return {'joined', ARGV[3], tonumber(h[2])}
  end
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
local t = now()
redis.call('HSET', KEYS[1], 'status', 'running', 'params', ARGV[4], 'prompt_ids', ARGV[5],
  'epoch', 1, 'owner', ARGV[6], 'created', t, 'updated', t, 'finish_reason', '',
  'committed', 0, 'request_id', ARGV[7], 'error', '', 'lease_until', later(ARGV[8]), 'read_at', t)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[3])
redis.call('EXPIRE', KEYS[5], ARGV[2])
return {'created', ARGV[3], 1}
"""
)

# One or more rounds' commits (a step's, on one Redis; a hash tag's, on a Cluster: ADR 0028), each
# fenced and applied in order, exactly as one round alone. KEYS: five a round (hash, tok, out,
# rounds, running). ARGV[1..2]: prefix, ttl; then a round's epoch, expected_len, round_id, text,
# finish_reason ('' = not final), stats ('' = none: a finished run's statistics, written with its
# last commit), n and its n token ids. Returns {status, committed length} a round, flat.
# The keys' TTL is refreshed where the hash's has run below half (all five are refreshed together,
# and at a session's first commit, which creates three of them): EXPIRE on five keys a round was a
# fifth of the script's time. TIME is read once a call.
COMMIT = (
    _LUA_HELPERS
    + """
local out, a, t = {}, 3, now()
local half = tonumber(ARGV[2]) / 2
for k = 0, #KEYS - 5, 5 do
  local epoch, expected, round_id, finish = ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 4]
  local first, last = a + 7, a + 6 + tonumber(ARGV[a + 6])
  local len = redis.call('LLEN', KEYS[k + 2])
  local status = 'ok'
  if redis.call('SISMEMBER', KEYS[k + 4], round_id) == 1 then
    status = 'duplicate'
  else
    local h = redis.call('HMGET', KEYS[k + 1], 'status', 'epoch')
    if not h[1] then status = 'missing'
    elseif h[1] ~= 'running' then status = 'closed'
    elseif tonumber(h[2]) ~= tonumber(epoch) then status = 'stale_epoch'
    elseif len ~= expected then status = 'stale_len'
    end
  end
  if status == 'ok' then
    -- XADD first: it is the only write that could fail, and a failed script is not rolled back.
    redis.call('XADD', KEYS[k + 3], len .. '-1', 'offset', len, 'tokens', table.concat(ARGV, ',', first, last),
      'text', ARGV[a + 3], 'finish_reason', finish)
    for i = first, last, 1000 do  -- unpack() has a stack limit
      redis.call('RPUSH', KEYS[k + 2], unpack(ARGV, i, math.min(i + 999, last)))
    end
    local n = len + last - first + 1
    redis.call('SADD', KEYS[k + 4], round_id)
    redis.call('HSET', KEYS[k + 1], 'committed', n, 'updated', t)
    if ARGV[a + 5] ~= '' then redis.call('HSET', KEYS[k + 1], 'stats', ARGV[a + 5]) end
    if finish ~= '' then
      redis.call('HSET', KEYS[k + 1], 'status', 'finished', 'finish_reason', finish)
      redis.call('SREM', KEYS[k + 5], string.match(KEYS[k + 1], '(%x+)$'))
    end
    if len == 0 or finish ~= '' or redis.call('TTL', KEYS[k + 1]) < half then
      for j = k + 1, k + 5 do redis.call('EXPIRE', KEYS[j], ARGV[2]) end
    end
    len = n
  end
  out[#out + 1] = status
  out[#out + 1] = len
  a = last + 1
end
return out
"""
)

# Cancel and fail. KEYS: hash, tok, out, rounds, running. ARGV[3..6]: status, finish_reason, error,
# epoch ('' = any: a client's Cancel is not fenced, a router's fail is).
CLOSE = (
    _LUA_HELPERS
    + """
local len = redis.call('LLEN', KEYS[2])
local h = redis.call('HMGET', KEYS[1], 'status', 'epoch')
if not h[1] then return {'missing', len} end
if h[1] ~= 'running' then return {'closed', len} end
if ARGV[6] ~= '' and tonumber(h[2]) ~= tonumber(ARGV[6]) then return {'stale_epoch', len} end
redis.call('XADD', KEYS[3], len .. '-1', 'offset', len, 'tokens', '', 'text', '',
  'finish_reason', ARGV[4], 'error', ARGV[5])
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finish_reason', ARGV[4], 'error', ARGV[5],
  'updated', now())
redis.call('SREM', KEYS[5], session_id())
touch()
return {'ok', len}
"""
)

# KEYS: hash, tok, out, rounds, running. ARGV[3..5]: owner, lease_s, only_if_lapsed ('1' or '').
# Returns the new epoch; 0 if missing, -1 if closed, -2 if the owner's lease still holds.
TAKE_OVER = (
    _LUA_HELPERS
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'lease_until')
if not h[1] then return 0 end
if ARGV[5] ~= '' then
  if h[1] ~= 'running' then return -1 end
  if h[2] and tonumber(h[2]) > tonumber(now()) then return -2 end
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'updated', now(), 'lease_until', later(ARGV[4]))
touch()
return epoch
"""
)

# The owner's heartbeat. KEYS: hash, tok, out, rounds, running. ARGV[3..4]: epoch, lease_s.
# Returns {status, seconds since a client last read it (read_at, set by readers)}.
HEARTBEAT = (
    _LUA_HELPERS
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'epoch', 'read_at')
if not h[1] then return {'missing', '0'} end
if h[1] ~= 'running' then return {'closed', '0'} end
if tonumber(h[2]) ~= tonumber(ARGV[3]) then return {'stale_epoch', '0'} end
local t = now()
if not h[3] then h[3] = t; redis.call('HSET', KEYS[1], 'read_at', t) end
redis.call('HSET', KEYS[1], 'lease_until', later(ARGV[4]))
touch()
return {'ok', string.format('%.3f', tonumber(t) - tonumber(h[3]))}
"""
)

# A router's claim to re-place a session whose driver's lease lapsed: one router wins per
# claim period, and nothing is fenced here (the target that takes the session bumps the
# epoch). KEYS: hash, claim. ARGV: owner, claim_ms. Returns 1 for the winner.
CLAIM = (
    _LUA_HELPERS
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'lease_until')
if h[1] ~= 'running' then return 0 end
if h[2] and tonumber(h[2]) > tonumber(now()) then return 0 end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
)

# KEYS: hash. One round trip, and never recreates a hash that expired (it would have no TTL).
MARK_READ = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'read_at', t[1] .. '.' .. string.format('%06d', t[2]))
end
"""
