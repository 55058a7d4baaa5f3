"""The Lua scripts of the Redis tier, and how one rides in a pipeline (DESIGN §6).

Every script touches the keys of one slot on Redis Cluster, except ``COMMIT_INDEXED_LUA``,
which also touches the key index and the accounting keys (other slots), so only a single
server runs it: there one round trip does what a cluster needs two for. No script moves
chunk bytes: a value copied through Lua costs more than its round trip.

- ``COMMIT_LUA``     — KEYS manifest, pending chunks…, final chunks…; ARGV manifest, ttl.
  Renames every pending chunk to its final name (with the final TTL) and writes the
  manifest LAST; refuses when another manifest exists (-1) or a pending chunk is gone (0),
  deleting this store's pending chunks either way. Finding its own manifest (the bytes
  name the store) it answers 1 again, so a retried commit is harmless. Returns
  ``{status, bytes, objects}``.
- ``COMMIT_INDEXED_LUA`` — the same, then the key index entry and the accounting "add"
  (both idempotent), all at once. KEYS manifest, index, the five accounting keys, pending…, final…; ARGV
  manifest, ttl, object id hex, size, index entry value ("version:stream hex").
- ``COMMIT_BATCH_INDEXED_LUA`` — ``COMMIT_INDEXED_LUA`` for a batch of objects, in order, in
  one call (single server). KEYS the five accounting keys, then per object manifest,
  index, pending…, final…; ARGV ttl, then per object chunk count, manifest, object id hex,
  size, index entry value. Returns ``{any committed, bytes, objects, status…}``.
- ``ACCOUNTING_LUA`` — add / touch / remove / status of the accounting keys (lru, sizes,
  bytes, clock, expiry), pruning entries whose TTL has passed (on "status", which eviction
  calls first, and on every call of a node with a TTL). ``{changed, bytes, objects}``.
- ``Scripts`` — one client's scripts: ``load_all()`` (at start), ``command(name, keys, args)``
  (an EVALSHA to send with other commands), ``result_of(reply, name, keys, args)`` (which
  runs it again when it met NOSCRIPT: a restarted server lost its script cache, and raises
  any other error reply) and ``call(name, keys, args)``.
"""

from __future__ import annotations

from typing import Any, Sequence

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoScriptError

_ACCOUNT_FN = """
local function account(k, op, id, size, ttl)
  local function drop(x)
    local bytes = redis.call('HGET', k[2], x)
    redis.call('ZREM', k[1], x)
    redis.call('ZREM', k[5], x)
    if bytes then
      redis.call('HDEL', k[2], x)
      redis.call('DECRBY', k[3], bytes)
      return 1
    end
    return 0
  end
  local now = 0
  if ttl > 0 or op == 'status' then  -- only nodes with a TTL leave expiry entries to prune
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1000000
    for _, x in ipairs(redis.call('ZRANGEBYSCORE', k[5], '-inf', now, 'LIMIT', 0, 128)) do
      drop(x)
    end
  end
  local changed = 0
  if op == 'add' then
    if redis.call('HSETNX', k[2], id, size) == 1 then
      redis.call('INCRBY', k[3], size)
      changed = 1
    end
    redis.call('ZADD', k[1], redis.call('INCR', k[4]), id)
    if ttl > 0 then
      redis.call('ZADD', k[5], string.format('%.6f', now + ttl), id)
    end
  elseif op == 'touch' then
    changed = redis.call('ZADD', k[1], 'XX', 'CH', redis.call('INCR', k[4]), id)
  elseif op == 'remove' then
    changed = drop(id)
  end
  return {changed, tonumber(redis.call('GET', k[3]) or '0'), redis.call('ZCARD', k[1])}
end
"""

_COMMIT_FN = """
local function commit(manifest, first, n, body, ttl)
  local function abandon(status)
    for i = first, first + n - 1 do
      redis.call('DEL', KEYS[i])
    end
    return status
  end
  local current = redis.call('GET', manifest)
  if current then  -- this very manifest when the call is a retry whose reply was lost
    return abandon(current == body and 1 or -1)
  end
  for i = first, first + n - 1 do
    if redis.call('EXISTS', KEYS[i]) == 0 then
      return abandon(0)
    end
  end
  for i = first, first + n - 1 do
    local final = KEYS[i + n]
    redis.call('RENAME', KEYS[i], final)
    if ttl > 0 then
      redis.call('EXPIRE', final, ttl)
    else
      redis.call('PERSIST', final)
    end
  end
  if ttl > 0 then
    redis.call('SET', manifest, body, 'EX', ttl)
  else
    redis.call('SET', manifest, body)
  end
  return 1
end
"""

COMMIT_LUA = _COMMIT_FN + """
return {commit(KEYS[1], 2, (#KEYS - 1) / 2, ARGV[1], tonumber(ARGV[2])), 0, 0}
"""

COMMIT_INDEXED_LUA = _ACCOUNT_FN + _COMMIT_FN + """
local ttl = tonumber(ARGV[2])
local status = commit(KEYS[1], 8, (#KEYS - 7) / 2, ARGV[1], ttl)
if status ~= 1 then
  return {status, 0, 0}
end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[5])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[2], ttl)
end
local r = account({KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, 'add', ARGV[3], ARGV[4], ttl)
return {1, r[2], r[3]}
"""

COMMIT_BATCH_INDEXED_LUA = _ACCOUNT_FN + _COMMIT_FN + """
local ttl = tonumber(ARGV[1])
local accounting = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]}
local out = {0, 0, 0}
local k, a = 6, 2
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  local status = commit(KEYS[k], k + 2, n, ARGV[a + 1], ttl)
  if status == 1 then
    redis.call('HSET', KEYS[k + 1], ARGV[a + 2], ARGV[a + 4])
    if ttl > 0 then
      redis.call('EXPIRE', KEYS[k + 1], ttl)
    end
    local r = account(accounting, 'add', ARGV[a + 2], ARGV[a + 3], ttl)
    out[1], out[2], out[3] = 1, r[2], r[3]
  end
  out[#out + 1] = status
  k = k + 2 + 2 * n
  a = a + 5
end
return out
"""

ACCOUNTING_LUA = _ACCOUNT_FN + """
return account(KEYS, ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]))
"""

_SOURCES = {"commit": COMMIT_LUA, "commit_indexed": COMMIT_INDEXED_LUA,
            "commit_batch_indexed": COMMIT_BATCH_INDEXED_LUA, "accounting": ACCOUNTING_LUA}


class Scripts:
    """The scripts above, registered on one client (their SHA1 is computed locally)."""

    def __init__(self, client: Redis | RedisCluster) -> None:
        self._client = client
        self._scripts = {name: client.register_script(source) for name, source in _SOURCES.items()}

    async def load_all(self) -> None:
        """SCRIPT LOAD each one (on every primary of a cluster), so EVALSHA finds them."""
        for script in self._scripts.values():
            await self._client.script_load(script.script)

    def command(self, name: str, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
        """The EVALSHA command, for ``connect.exchange`` (no SCRIPT EXISTS round trip)."""
        return ("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)

    async def call(self, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run one script on its own; loads it first if the server lost it."""
        return await self._scripts[name](keys=keys, args=args)

    async def result_of(self, reply: Any, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The reply of a sent ``command``: NOSCRIPT (a restarted server lost its script
        cache) runs it again after loading it; any other error reply is raised."""
        if isinstance(reply, NoScriptError):
            return await self.call(name, keys, args)
        if isinstance(reply, BaseException):
            raise reply
        return reply
