"""The Lua scripts of `RedisSessionStore` (`redis_store.py`, where the keys are described):
each one read-check-write, atomic against every other router, on Redis' own clock."""

# Redis' clock in milliseconds; a session is live while expires_ms is ahead of it.
PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function live(key)
  local e = redis.call('HGET', key, 'expires_ms')
  return e and tonumber(e) > now
end
-- fn(id, key) of every live session in the expiry index. The session keys are built here,
-- not declared: one more reason for one Redis, not a Cluster.
local function each_live(index, prefix, fn)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', index, '(' .. now, '+inf')) do
    local key = prefix .. '{' .. id .. '}:s'
    if live(key) then fn(id, key) end
  end
end
-- A sorted set of leases goes when its last lease ends (none of it is needed after that).
local function expire_with_last(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIREAT', key, last[2]) end
end
-- A session's copies are one field, replica ids joined by commas: `list` without `item`.
local function without(list, item)
  local out = {}
  for r in string.gmatch(list or '', '[^,]+') do
    if r ~= item then out[#out + 1] = r end
  end
  return table.concat(out, ',')
end
"""

# KEYS: session, text, tombstone, expiry index, reservations. ARGV: id, text, ttl_ms, grace_ms,
# reservation, then the hash's field/value pairs. Returns expires_ms, or 0 if the id is taken
# or tombstoned.
_CREATE = """
if redis.call('EXISTS', KEYS[1], KEYS[3]) > 0 then return 0 end
local ttl = tonumber(ARGV[3])
local expires = now + ttl
redis.call('ZREM', KEYS[5], ARGV[5])
redis.call('HSET', KEYS[1], 'ttl_ms', ttl, 'expires_ms', expires, unpack(ARGV, 6))
redis.call('PEXPIRE', KEYS[1], ttl + ARGV[4])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ttl + ARGV[4])
redis.call('ZADD', KEYS[4], expires, ARGV[1])
return expires
"""

# KEYS: session. Returns the hash as a flat list, or nil.
_GET = """
if not live(KEYS[1]) then return false end
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: session, text. Returns the stored text, or nil.
_TEXT = """
if not live(KEYS[1]) then return false end
return redis.call('GET', KEYS[2])
"""

# KEYS: session, text, expiry index. ARGV: id, grace_ms, hold_ms. Returns the new expires_ms,
# or nil.
_TOUCH = """
if not live(KEYS[1]) then return false end
local ttl = math.max(tonumber(redis.call('HGET', KEYS[1], 'ttl_ms')), tonumber(ARGV[3]))
local expires = now + ttl
redis.call('HSET', KEYS[1], 'expires_ms', expires)
redis.call('PEXPIRE', KEYS[1], ttl + ARGV[2])
redis.call('PEXPIRE', KEYS[2], ttl + ARGV[2])
redis.call('ZADD', KEYS[3], expires, ARGV[1])
return expires
"""

# KEYS: expiry index. ARGV: key prefix. Every live session's holders and tenant: id, replica,
# copies, tenant, id, ... ("" for none). Run by every router every poll: three fields a
# session, not the hash.
_HOLDINGS = """
local out = {}
each_live(KEYS[1], ARGV[1], function(id, key)
  local held = redis.call('HMGET', key, 'replica', 'copies', 'tenant')
  out[#out + 1] = id
  out[#out + 1] = held[1] or ''
  out[#out + 1] = held[2] or ''
  out[#out + 1] = held[3] or ''
end)
return out
"""

# KEYS: session. ARGV: expected replica, new replica ("" = none), "1" if the new one must be a
# copy now (a promotion). Returns 1 if it was swapped. A copy bound as the primary (promoted)
# is no longer one of the copies.
_REBIND = """
if not live(KEYS[1]) then return 0 end
if redis.call('HGET', KEYS[1], 'replica') ~= ARGV[1] then return 0 end
local copies = redis.call('HGET', KEYS[1], 'copies') or ''
local rest = without(copies, ARGV[2])
if ARGV[3] == '1' and rest == copies then return 0 end
redis.call('HSET', KEYS[1], 'replica', ARGV[2], 'copies', rest)
return 1
"""

# KEYS: session, expiry index. ARGV: replica, most holders (the primary and its copies), key
# prefix, most session slots of the tenant ("" for no limit). Returns 1 if the replica was
# added as a copy: the session is live, the replica holds none of it yet, its holders stay
# within the limit, and its tenant's sessions and their copies within the tenant's.
_ADD_COPY = """
if not live(KEYS[1]) then return 0 end
if redis.call('HGET', KEYS[1], 'replica') == ARGV[1] then return 0 end
local copies = redis.call('HGET', KEYS[1], 'copies') or ''
local held = 1
for r in string.gmatch(copies, '[^,]+') do
  if r == ARGV[1] then return 0 end
  held = held + 1
end
if held >= tonumber(ARGV[2]) then return 0 end
if ARGV[4] ~= '' then
  local tenant, slots = redis.call('HGET', KEYS[1], 'tenant'), 0
  each_live(KEYS[2], ARGV[3], function(_, key)
    local session = redis.call('HMGET', key, 'tenant', 'copies')
    if session[1] == tenant then
      slots = slots + 1
      for _ in string.gmatch(session[2] or '', '[^,]+') do slots = slots + 1 end
    end
  end)
  if slots >= tonumber(ARGV[4]) then return 0 end
end
if copies ~= '' then copies = copies .. ',' end
redis.call('HSET', KEYS[1], 'copies', copies .. ARGV[1])
return 1
"""

# KEYS: session, the copies' leases. ARGV: replica, idle_ms ("" to drop it whatever holds
# it). Returns 1 if the live session had a copy there (now dropped); 0 if not, or if a
# query's lease holds it or one was taken or given back within idle_ms.
_DROP_COPY = """
if not live(KEYS[1]) then return 0 end
local copies = redis.call('HGET', KEYS[1], 'copies') or ''
local kept = without(copies, ARGV[1])
if kept == copies then return 0 end
local mine = ARGV[1] .. '|'
if ARGV[2] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  for _, lease in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if string.sub(lease, 1, #mine) == mine then return 0 end
  end
  local used = redis.call('HGET', KEYS[1], 'used:' .. ARGV[1])
  if used and now - tonumber(used) < tonumber(ARGV[2]) then return 0 end
end
redis.call('HSET', KEYS[1], 'copies', kept)
redis.call('HDEL', KEYS[1], 'used:' .. ARGV[1])
return 1
"""

# KEYS: session, the copies' leases. ARGV: replica, lease (`replica|id`), lease_ms. Returns 1
# if the live session has a copy there, now held by the lease.
_LEASE_COPY = """
if not live(KEYS[1]) then return 0 end
local found = false
for r in string.gmatch(redis.call('HGET', KEYS[1], 'copies') or '', '[^,]+') do
  if r == ARGV[1] then found = true end
end
if not found then return 0 end
redis.call('ZADD', KEYS[2], now + ARGV[3], ARGV[2])
expire_with_last(KEYS[2])
redis.call('HSET', KEYS[1], 'used:' .. ARGV[1], now)
return 1
"""

# KEYS: session, the copies' leases. ARGV: replica, lease. The query ended: the copy was used
# now (if it is still one).
_RELEASE_COPY = """
if redis.call('ZREM', KEYS[2], ARGV[2]) == 1 and live(KEYS[1]) then
  redis.call('HSET', KEYS[1], 'used:' .. ARGV[1], now)
end
"""

# KEYS: session, text, tombstone, expiry index. ARGV: id, tombstone_ms. Returns the hash as
# it was (empty if there was none).
_DELETE = """
local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
return fields
"""

# KEYS: expiry index. ARGV: how many. Ids whose expiry has passed.
_EXPIRED = """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[1])
"""

# KEYS: session, text, expiry index. ARGV: id. Claims an expired session for one sweeper:
# returns its hash (empty if Redis already dropped it), or nil if another router claimed it
# first or it was renewed meanwhile.
_CLAIM = """
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) or live(KEYS[1]) then return false end
local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
return fields
"""

# KEYS: the tenant's requests. ARGV: request id, limit, window_ms. Returns nil if counted,
# else the ms until the oldest request leaves the window.
_ADMIT_REQUEST = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ARGV[3])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tonumber(oldest[2]) + ARGV[3] - now
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return false
"""

# KEYS: the tenant's jobs. ARGV: job id, limit, lease_ms. Returns nil if counted, else how
# many jobs run (leases not expired).
_START_JOB = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local running = redis.call('ZCARD', KEYS[1])
if running >= tonumber(ARGV[2]) then return running end
redis.call('ZADD', KEYS[1], now + ARGV[3], ARGV[1])
expire_with_last(KEYS[1])
return false
"""

# KEYS: each job's tenant's jobs. ARGV: lease_ms, then each job's id. A lease that ended is
# not renewed: its job stopped counting, maybe for good (an `end_job` raced this renewal).
_RENEW_JOBS = """
for i, key in ipairs(KEYS) do
  local until_ms = redis.call('ZSCORE', key, ARGV[i + 1])
  if until_ms and tonumber(until_ms) > now then
    redis.call('ZADD', key, now + ARGV[1], ARGV[i + 1])
    expire_with_last(key)
  end
end
"""

# KEYS: expiry index, reservations. ARGV: key prefix, reservation (`id|tenant`), tenant, limit,
# lease_ms. Returns nil if the tenant holds `limit` sessions and reservations, else every
# tenant's session slots with this reservation (a session's copies hold one each): tenant,
# count, tenant, count, ...
_RESERVE = """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local documents, held = {}, {}
local function count(tenant, copies)
  documents[tenant] = (documents[tenant] or 0) + 1
  held[tenant] = (held[tenant] or 0) + 1 + copies
end
each_live(KEYS[1], ARGV[1], function(_, key)
  local session = redis.call('HMGET', key, 'tenant', 'copies')
  local copies = 0
  for _ in string.gmatch(session[2] or '', '[^,]+') do copies = copies + 1 end
  count(session[1], copies)
end)
for _, reservation in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  count(string.sub(reservation, string.find(reservation, '|', 1, true) + 1), 0)
end
if (documents[ARGV[3]] or 0) >= tonumber(ARGV[4]) then return false end
redis.call('ZADD', KEYS[2], now + ARGV[5], ARGV[2])
count(ARGV[3], 0)
local out = {}
for tenant, n in pairs(held) do
  out[#out + 1] = tenant
  out[#out + 1] = n
end
return out
"""

# KEYS: a sorted set. ARGV: a member, removed (a job that ended, a reservation given back).
_REMOVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
"""

SCRIPTS = {
    "create": _CREATE,
    "get": _GET,
    "text": _TEXT,
    "touch": _TOUCH,
    "holdings": _HOLDINGS,
    "rebind": _REBIND,
    "add_copy": _ADD_COPY,
    "drop_copy": _DROP_COPY,
    "lease_copy": _LEASE_COPY,
    "release_copy": _RELEASE_COPY,
    "delete": _DELETE,
    "expired": _EXPIRED,
    "claim": _CLAIM,
    "admit_request": _ADMIT_REQUEST,
    "start_job": _START_JOB,
    "renew_jobs": _RENEW_JOBS,
    "reserve": _RESERVE,
    "remove": _REMOVE,
}
