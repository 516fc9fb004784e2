-- Shared by every script of the Redis state store. Loaded once as a Redis function library
-- (gateway/state/scripts.py: each script's body a function of it, so these definitions are
-- not made afresh on every call), or, on a Redis without functions (before 7.0), prepended
-- to each script body for EVALSHA. Either way a call begins with `begin(KEYS, ARGV)`.
--
-- KEYS (one hash tag, so one Cluster slot):
--   1 leases  HASH  lease id -> json {e engine, b blocks, s seqs, pb prompt blocks, t tenant,
--                   k tokens, r replica, rpm, tpm, p priority, w weight}
--   2 lexp    ZSET  lease id -> expiry (Redis time, s)
--   3 load    HASH  "b:<engine>" / "s:<engine>" / "p:<engine>" -> reserved blocks / sequences
--                   / the prompt blocks among the reserved blocks
--   4 ten     HASH  "n:<tenant>" / "k:<tenant>" -> requests in flight / blocks held
--   5 rate    HASH  "<tenant>:rl" "<tenant>:rs" (requests level, stamp), ":tl" ":ts" (tokens)
--   6 q       ZSET  score 0, member "<prio10>:<start24>:<seq16>:<id>": the line, in order
--   7 qent    HASH  entry id -> json {m member, q qtf member, t, p, b, e engines ('\n'
--                   between), s, f, r owner replica, d deadline (arrival + max wait,
--                   Redis time)}
--   8 qexp    ZSET  entry id -> expiry: min(deadline, last renewal by its replica + lease ttl)
--   9 qtf     ZSET  score 0, member "<tenant>\0<prio10>:<start24>:<seq16>:<id>"
--  10 fair    HASH  "v:<prio>" virtual time when idle, "vf:<prio>" V before the last change
--                   of the line (V never goes back), "f:<prio>:<tenant>" served finish tag,
--                   "seq" arrival counter
--  11 act     HASH  tenant -> json {w weight, s last seen, u recent usage, us its stamp,
--                   n window s, h held blocks as counted in acts, b its last request's
--                   blocks} (all strings, %.17g):
--                   the headroom rule's memory, one record per active tenant
--  12 pfx     HASH  "<engine>\0<block hash hex>" -> live leases holding that prefix block
--                   on that engine (gateway/core/prefix.py PrefixHolds); a lease's json
--                   then has h (its prefix hashes, hex) and c (its credit at admission)
--  13 acts    HASH  the active tenants' aggregates, kept as records change (issue 14):
--                   "n" records counted (= HLEN act, else rebuilt from act; a record
--                   without h, from an older version, drops it), "h" the sum
--                   of their held blocks, "w:<k>" limb k of the exact sum of their weights
--                   (each weight x 2^1074, in 24-bit limbs; integers, so no drift)
--  14 actr    ZSET  tenant -> held / weight, for the tenants holding blocks (those above a
--                   share are the first few from the top)
--  15 acta    ZSET  tenant -> last seen, for the tenants holding nothing and not queued
--                   (the next to age out of the window first); act, acts, actr, acta and
--                   actb always share one TTL (touch), so they expire together
--  16 fairh   ZSET  "<prio>:<tenant>" -> when its served tag "f:<prio>:<tenant>" stops
--                   mattering (F + B / weight: V past it); forgotten then (fairqueue.py)
--  17 actb    ZSET  tenant -> (min(u, h) + b) / w (below the same with its usage now), for
--                   the tenants holding blocks whose record has b: the burst claims
--                   (headroom.py burst_claim) that may hold at a share are the first few
--                   from the bottom; in the records' TTL group
--  18 views   HASH  engine -> its view as the scheduler last pushed it (`set_views`, the
--                   newest push wins): "usable blocks,max_num_seqs,staged seqs,foreign
--                   blocks,foreign seqs,healthy 1/0" (issue 14, docs/engine-index.md)
--  19 grp     HASH  the named engine groups (`set_group`): "<g>" its KV ceiling, "<g>:m" its
--                   engines (sorted, '\n' between), "<g>:c" / "<g>:f" / "<g>:n" the sums of
--                   its engines' capacities, free blocks (each at least 0) and count (those
--                   with a view), "<g>:k:<cap>,<seqs>,<staged>" -> kind number, "<g>:K:<n>"
--                   the kind back, "<g>:kc:<n>" engines of that kind, "<g>:kn" kinds so
--                   far, "<g>\0<engine>" -> "cap,seqs,staged|free|kind|its member in gord
--                   ('' when out)"
--  20 eg      HASH  engine -> the groups it belongs to ('\n' between)
--  21 gord    ZSET  score 0, member "<g>\0<rank>\0<engine>" for each engine of a group
--                   that could take a one-sequence request (healthy, a free slot): rank =
--                   %012.0f of 1e11 - free, %07.0f running, %05.0f kind, so a group's
--                   engines read in lex order are best first (engine_order.py)
--  22 pfh     ZSET  score 0, member "<first prefix hash hex>\0<engine>": the engines where
--                   live leases hold a prefix beginning with that hash (prefix credit)
--  23 gone    ZSET  lease id -> when its replica released it while one of its renewal
--                   rounds was on its way (release.lua), for 60 s: that round's script does
--                   not write it again
--  24 gused   ZSET  group -> its last use (a grouped ask or `set_group`, Redis time): a
--                   group unused for a key TTL is dropped (renew.lua, `eng.sweep`)
--  25 touch   STRING the TTL clock (always the last key): set by each full `touch` for 1 %
--                   of the key TTL; while it lives, a call checks the TTLs of only the keys it
--                   may have created
-- ARGV[1] key TTL (s), ARGV[2] change channel, ARGV[3] the time ('' = Redis TIME; tests
-- give their clock's, `RedisStore(clock=...)`); the script's own arguments follow.

-- The standard functions as upvalues, bound by `begin` at each call: a script's globals are
-- looked up through Redis's protected global table (a loop of 2,000 `tonumber` and
-- `math.max` calls: 565 µs, 345 µs with them as locals), and a library's are not there yet
-- while it loads.
local function standard() -- defined before the locals below: here these are the globals
  return tonumber, tostring, pairs, ipairs, unpack, math, string, table, cjson
end
local tonumber, tostring, pairs, ipairs, unpack, math, string, table, cjson

-- The call's keys, shared arguments, clock and what it changed: set by `begin`, once per
-- call (a library's functions share these upvalues; Redis runs one call at a time).
local K_LEASES, K_LEXP, K_LOAD, K_TEN, K_RATE
local K_Q, K_QENT, K_QEXP, K_QTF, K_FAIR
local K_ACT, K_PFX, K_ACTS, K_ACTR, K_ACTA, K_FAIRH, K_ACTB, K_TOUCH
local K_VIEWS, K_GRP, K_EG, K_GORD, K_PFH, K_GONE
local ALL_KEYS, KEY_TTL_MS, CHANNEL, NOW, USEC
-- What this script changed for waiters (published by `finish`): `released` capacity (a
-- lease ended), the entries that `departed` the line, the entries that `moved` up when an
-- earlier entry of their tenant left unserved.
local released, departed, moved
-- The headroom records read by this call, decoded (tenant -> record, false: none): a call
-- reads its tenant's several times (the rule, `observe`, `settle`); writes drop them.
local records
-- V of each priority class as this call computed it (prio -> V): read several times by one
-- admission (its start tag, `hold_v`, the charge's tag, the pruning); a change of the line or
-- of the class's V drops it (`hold_v` sets what V already is).
local vnow
-- The fair hash's fields as this call read or wrote them (field -> value, false: none), but
-- "seq": one admission reads V, the held V and the tenant's served tag several times (its
-- start tag, the charge's tag, the pruning); every other read and write goes through here.
local fair
-- The ends of the line as this call read them: each class's first start tag (prio -> tag,
-- false: nobody queued) and each tenant's last finish tag in a class (tenant \0 prio -> tag,
-- false: none); read again by the pruning and the charge's tag, dropped by `line_changed`.
local firstq, lastq
-- The keys this call may have created (key -> true): a write that added a field or a member,
-- or a counter that now holds just what was added. `finish` gives such a key a TTL.
local made
-- The groups' KV ceilings (group -> ceiling, false: no such group) and kinds (group \0 kind
-- -> {cap, seqs, staged}) as this call read them.
local ceilings, kinds

local function begin(keys, argv)
  tonumber, tostring, pairs, ipairs, unpack, math, string, table, cjson = standard()
  ALL_KEYS = keys
  K_LEASES, K_LEXP, K_LOAD, K_TEN, K_RATE = keys[1], keys[2], keys[3], keys[4], keys[5]
  K_Q, K_QENT, K_QEXP, K_QTF, K_FAIR = keys[6], keys[7], keys[8], keys[9], keys[10]
  K_ACT, K_PFX, K_ACTS, K_ACTR = keys[11], keys[12], keys[13], keys[14]
  K_ACTA, K_FAIRH, K_ACTB = keys[15], keys[16], keys[17]
  K_VIEWS, K_GRP, K_EG, K_GORD, K_PFH = keys[18], keys[19], keys[20], keys[21], keys[22]
  K_GONE = keys[23]
  K_TOUCH = keys[#keys] -- the TTL clock is the last key (redis.py KEY_NAMES)
  KEY_TTL_MS = math.floor(tonumber(argv[1]) * 1000)
  CHANNEL = argv[2]
  if argv[3] == '' then
    local clock = redis.call('TIME')
    NOW = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
    USEC = tonumber(clock[2])
  else -- a test's clock: the same seconds the in-process store is given
    NOW = tonumber(argv[3])
    USEC = math.floor(NOW * 1e6 + 0.5) % 1000000
  end
  released, departed, moved = false, {}, {}
  records = {}
  vnow = {}
  fair = {}
  firstq, lastq = {}, {}
  made = {}
  ceilings, kinds = {}, {}
end

local NEWCOMER_SEQ = '9999999999999999'

local function opt(x)
  if x == nil or x == '' then return nil end
  return tonumber(x)
end

local function fmt(x)
  return string.format('%.17g', x)
end

local function num(x)
  return tonumber(x) or 0
end

-- A decoded JSON field that is there: neither missing (nil) nor JSON null (cjson.null).
local function present(x)
  return x ~= nil and x ~= cjson.null
end

-- The writes that can create a key, noting in `made` the keys they may have created (a key
-- they create always shows as a field or member added, or a counter equal to its delta).
local function hset(key, ...)
  local n = redis.call('HSET', key, ...)
  if n > 0 then made[key] = true end
  return n
end

local function zadd(key, ...)
  local n = redis.call('ZADD', key, ...)
  if n > 0 then made[key] = true end
  return n
end

local function hincrby(key, field, delta)
  local v = redis.call('HINCRBY', key, field, delta)
  if v == delta then made[key] = true end
  return v
end

-- Add to a counter field; a field that reaches 0 is deleted (nothing left behind).
-- Returns the counter's new value (nil when `delta` is 0: not read).
local function add(key, field, delta)
  if delta == 0 then return nil end
  local v = hincrby(key, field, delta)
  if v == 0 then redis.call('HDEL', key, field) end
  return v
end

-- ---- token buckets (gateway/core/tenants.py) -------------------------------------------
local function bucket_level(tenant, kind, limit)
  local got = redis.call('HMGET', K_RATE, tenant .. ':' .. kind .. 'l', tenant .. ':' .. kind .. 's')
  if not got[1] then return limit end
  local refill = limit / 60 * math.max(0, NOW - tonumber(got[2]))
  return math.min(limit, tonumber(got[1]) + refill)
end

local function bucket_set(tenant, kind, limit, level)
  local l, s = tenant .. ':' .. kind .. 'l', tenant .. ':' .. kind .. 's'
  if level >= limit then
    redis.call('HDEL', K_RATE, l, s) -- a missing bucket is a full one
  else
    hset(K_RATE, l, fmt(level), s, fmt(NOW))
  end
end

local function seconds_until(units, level, limit)
  if level >= units then return 0 end
  return (units - level) / (limit / 60)
end

-- ---- headroom (gateway/core/headroom.py) -------------------------------------------------
-- How many entries the tenant has in the line.
local function tenant_queued(tenant)
  return redis.call('ZLEXCOUNT', K_QTF, '[' .. tenant .. '\0', '(' .. tenant .. '\1')
end

-- A record without h was written by the scripts before issue 14 (a replica not yet
-- upgraded): not counted as it is now (`stale`).
local function decoded(raw)
  local a = cjson.decode(raw)
  return {w = tonumber(a.w), s = tonumber(a.s), u = tonumber(a.u), us = tonumber(a.us),
          n = tonumber(a.n), h = tonumber(a.h) or 0, b = tonumber(a.b) or 0, stale = a.h == nil}
end

local function activity(tenant)
  local a = records[tenant]
  if a == nil then
    local raw = redis.call('HGET', K_ACT, tenant)
    a = raw and decoded(raw) or false
    records[tenant] = a
  end
  return a or nil
end

-- The recent usage at NOW, the tenant having held `held` blocks since the last update.
local function average_at(a, held, window)
  if a == nil then
    if window > 0 then return 0 end
    return held
  end
  if window <= 0 then return held end
  local decay = math.exp(-math.max(0, NOW - a.us) / window)
  return held + (a.u - held) * decay
end

-- The record just before the tenant's held blocks change from `held`; `weight` when the
-- tenant is seen (admitted or queued), nil for a release (which needs a record); `need`
-- the blocks of the request it is seen with (nil: the last one's, kept). Not written:
-- `settle` writes it once the blocks or entries changed.
local function observe(tenant, weight, held, window, need)
  local a = activity(tenant)
  if weight == nil and a == nil then return nil end
  if window == nil then window = a.n end
  local rec = {u = average_at(a, held, window), us = NOW, n = window, h = a and a.h or 0,
               b = need or (a and a.b or 0)}
  if weight ~= nil then
    rec.w, rec.s = weight, NOW
  else
    rec.w, rec.s = a.w, a.s
  end
  return rec
end

-- ---- the active tenants' aggregates (gateway/state/active.py) ---------------------------
-- The sum of the weights is kept exact: each weight is a whole multiple of 2^-1074, kept
-- as weight x 2^1074 in 24-bit limbs ("w:<k>" holds the sum of the tenants' limb k, an
-- integer < 2^53 for up to 2^29 tenants); `weight_sum` rounds the sum once, correctly (as
-- active.py's `_unscaled`), whatever the order the tenants came and went in.
local LIMB = 16777216 -- 2^24
local TWO53 = 9007199254740992

local function limbs(w)
  local f, x = math.frexp(w)
  local m, p = f * TWO53, x - 53 + 1074 -- w = m x 2^(p - 1074), m an integer < 2^53
  if p < 0 then m, p = m / 2 ^ (-p), 0 end -- subnormal: m has as many trailing zeros
  local k = math.floor(p / 24)
  local v = m * 2 ^ (p - 24 * k)
  local out = {}
  while v > 0 do
    local low = v % LIMB
    if low > 0 then out[k] = low end
    v = (v - low) / LIMB
    k = k + 1
  end
  return out
end

local function add_weight(w, sign)
  for k, v in pairs(limbs(w)) do add(K_ACTS, 'w:' .. k, sign * v) end
end

-- The correctly rounded value of the limbs `sums` (k -> integer) less the limbs `minus`.
local function weight_sum(sums, minus)
  local l, top, bottom = {}, -1, nil
  for k, v in pairs(sums) do
    l[k] = v
    if k > top then top = k end
    if bottom == nil or k < bottom then bottom = k end
  end
  if minus then
    for k, v in pairs(minus) do
      l[k] = (l[k] or 0) - v
      if k > top then top = k end
      if bottom == nil or k < bottom then bottom = k end
    end
  end
  if bottom == nil then return 0 end
  local carry = 0
  for k = bottom, top do
    local v = (l[k] or 0) + carry
    local low = v % LIMB
    carry = (v - low) / LIMB
    l[k] = low
  end
  while carry > 0 do
    top = top + 1
    local low = carry % LIMB
    l[top] = low
    carry = (carry - low) / LIMB
  end
  while top >= bottom and l[top] == 0 do top = top - 1 end
  if top < bottom then return 0 end
  -- The top four limbs as two exact 48-bit halves, V = hi x 2^48 + lo; its top bit q (72 to
  -- 95); the 53 bits from q down are m = floor(V / 2^s), s = q - 52 (20 to 43, so both
  -- terms below are exact), the rest decides the rounding with the limbs below (sticky).
  local _, e = math.frexp(l[top])
  local q = 71 + e -- e - 1: the top bit of limb `top`, 0 to 23
  local s2 = q - 52
  local result_exp = 24 * (top - 3) + s2 - 1074 -- the unit of m
  if result_exp + 52 >= -1022 then -- a normal result (subnormal: the bit by bit way below)
    local hi = l[top] * LIMB + (l[top - 1] or 0)
    local lo = (l[top - 2] or 0) * LIMB + (l[top - 3] or 0)
    local scale = 2 ^ s2
    local lo_high = math.floor(lo / scale)
    local m = hi * 2 ^ (48 - s2) + lo_high
    local r = lo - lo_high * scale
    local half = scale / 2
    local round, sticky = r >= half, r % half > 0
    if not sticky then
      for k = bottom, top - 4 do
        if (l[k] or 0) > 0 then
          sticky = true
          break
        end
      end
    end
    if round and (sticky or m % 2 == 1) then m = m + 1 end -- to nearest, ties to even
    return math.ldexp(m, result_exp)
  end
  for k = 0, top do l[k] = l[k] or 0 end
  local function bit(i)
    local k = math.floor(i / 24)
    return math.floor(l[k] / 2 ^ (i - 24 * k)) % 2
  end
  local pos = 24 * top + 23 -- the highest bit set
  while bit(pos) == 0 do pos = pos - 1 end
  if pos < 53 then -- fits: exactly
    local m = 0
    for i = pos, 0, -1 do m = 2 * m + bit(i) end
    return math.ldexp(m, -1074)
  end
  local m = 0
  for i = pos, pos - 52, -1 do m = 2 * m + bit(i) end
  local round, sticky = bit(pos - 53), false
  local below = pos - 54 -- any bit at or below it set?
  if below >= 0 then
    local k = math.floor(below / 24)
    if l[k] % 2 ^ (below - 24 * k + 1) > 0 then sticky = true end
    for j = 0, k - 1 do
      if l[j] > 0 then sticky = true end
    end
  end
  if round == 1 and (sticky or m % 2 == 1) then m = m + 1 end -- to nearest, ties to even
  return math.ldexp(m, pos - 52 - 1074)
end

-- The tenant's record `rec` (nil: its record as it is) now counts with `held`, the blocks
-- it holds now (nil: read them; a caller that has just changed them knows them), and the
-- entries it has now; nothing when it has no record (not active).
local function settle(tenant, rec, held)
  local old = activity(tenant)
  if rec == nil then rec = old end
  if rec == nil then return end
  if held == nil then held = num(redis.call('HGET', K_TEN, 'k:' .. tenant)) end
  if old ~= nil and old.stale then
    redis.call('HDEL', K_ACTS, 'n') -- not counted as it is: all rebuilt at the next use
  end
  if old == nil then
    add(K_ACTS, 'n', 1)
    add_weight(rec.w, 1)
    add(K_ACTS, 'h', held)
  else
    if old.w ~= rec.w then
      add_weight(old.w, -1)
      add_weight(rec.w, 1)
    end
    add(K_ACTS, 'h', held - old.h)
  end
  if held > 0 then
    zadd(K_ACTR, fmt(held / rec.w), tenant)
  elseif old ~= nil and old.h > 0 then
    redis.call('ZREM', K_ACTR, tenant)
  end
  -- acta holds the tenants with nothing held and nothing queued: a record that counts
  -- blocks held was written here with the tenant taken out of acta, so it is not there.
  if held <= 0 and tenant_queued(tenant) == 0 then
    zadd(K_ACTA, fmt(rec.s), tenant)
  elseif old == nil or old.h <= 0 then
    redis.call('ZREM', K_ACTA, tenant)
  end
  local b = rec.b or 0
  if held > 0 and b > 0 then
    zadd(K_ACTB, fmt((math.min(rec.u, held) + b) / rec.w), tenant)
  elseif old ~= nil then
    redis.call('ZREM', K_ACTB, tenant)
  end
  records[tenant] = nil
  hset(K_ACT, tenant, cjson.encode({
    w = fmt(rec.w), s = fmt(rec.s), u = fmt(rec.u), us = fmt(rec.us), n = fmt(rec.n),
    h = fmt(held), b = fmt(b),
  }))
end

local function forget(tenant, a)
  add(K_ACTS, 'n', -1)
  add_weight(a.w, -1)
  add(K_ACTS, 'h', -a.h)
  redis.call('ZREM', K_ACTR, tenant)
  redis.call('ZREM', K_ACTA, tenant)
  redis.call('ZREM', K_ACTB, tenant)
  redis.call('HDEL', K_ACT, tenant)
  records[tenant] = false
end

-- The aggregates again from the records, when they do not count them all (keys of an
-- older version, or lost): once, tenant by tenant.
local function rebuild()
  redis.call('DEL', K_ACTS, K_ACTR, K_ACTA, K_ACTB)
  local flat = redis.call('HGETALL', K_ACT)
  redis.call('DEL', K_ACT)
  records = {}
  for i = 1, #flat, 2 do settle(flat[i], decoded(flat[i + 1])) end
end

local function read_totals()
  local flat = redis.call('HGETALL', K_ACTS)
  local t = {n = 0, h = 0, w = {}}
  for i = 1, #flat, 2 do
    local f, v = flat[i], tonumber(flat[i + 1])
    if f == 'n' then
      t.n = v
    elseif f == 'h' then
      t.h = v
    else
      t.w[tonumber(string.sub(f, 3))] = v
    end
  end
  return t
end

-- The aggregates (acts as a table: n, h, and the weight limbs w), after forgetting the
-- tenants that are not active at NOW (nothing held, nothing queued, not seen within the
-- window): the first of acta while they are aged out, however many (each tenant once per
-- time it is seen: the tenants before issue 14's rule forgot, at the same calls).
local function active_now(window)
  local t = read_totals()
  local changed_totals = false
  if t.n ~= redis.call('HLEN', K_ACT) then
    rebuild()
    changed_totals = true
  end
  -- Only the aged-out are read (a bound a microsecond past the cutoff, then the exact test),
  -- not the first 100 of acta at every call.
  local bound = '(' .. fmt(NOW - window + 1e-6)
  while true do
    local got = redis.call('ZRANGEBYSCORE', K_ACTA, '-inf', bound, 'WITHSCORES', 'LIMIT', 0, 100)
    local stop = #got < 200
    for i = 1, #got, 2 do
      if not (NOW - tonumber(got[i + 1]) > window) then
        stop = true
        break
      end
      local a = activity(got[i])
      if a then
        forget(got[i], a)
      else
        redis.call('ZREM', K_ACTA, got[i])
      end
      changed_totals = true
    end
    if stop then break end
  end
  if changed_totals then t = read_totals() end
  return t
end

local function others_weight(t, own)
  return weight_sum(t.w, own and limbs(own.w) or nil)
end

-- The other active tenants' unused shares of `pool` (headroom.py unused_share, summed),
-- known without visiting every tenant (active.py Unused): `approx` from the totals (share x
-- weights - held, plus what the few tenants above their share hold beyond it), `slack`
-- how far the two float computations can differ; `unused_against(u, free)` is a value
-- that compares with the integer `free` as the tenant-by-tenant sum does (computed, from
-- every record, only when `free` is within `slack` of `approx`).
local EPSILON = 2 ^ -53

local function unused_of(t, tenant, own, weights, pool, total)
  local held = t.h - (own and own.h or 0)
  local per_weight = pool / total
  local approx = per_weight * weights - held
  local scale = per_weight * weights + held
  local above = redis.call('ZREVRANGEBYSCORE', K_ACTR, '+inf', fmt(per_weight * (1 - 1e-9)))
  for _, name in ipairs(above) do
    if name ~= tenant then
      local a = activity(name)
      approx = approx + math.max(0, a.h - a.w * per_weight)
      scale = scale + a.h + a.w * per_weight
    end
  end
  local n = t.n + #above
  return {approx = math.max(0, approx), slack = 4 * (n + 16) * EPSILON * (scale + 1) + 1e-9,
          tenant = tenant, pool = pool, total = total}
end

local function unused_against(u, free)
  if math.abs(free - u.approx) > u.slack then return u.approx end
  if u.exact == nil then
    local sum = 0
    local flat = redis.call('HGETALL', K_ACT)
    for i = 1, #flat, 2 do
      if flat[i] ~= u.tenant then
        local a = decoded(flat[i + 1])
        sum = sum + math.max(0, a.w * u.pool / u.total - a.h)
      end
    end
    u.exact = sum
  end
  return u.exact
end

local function over_share(held, need, average, weight, total, capacity)
  local share = weight * capacity
  return held > 0 and (held + need) * total > share and (average + need) * total > share
end

-- A holder's burst claim and its excess over its unused share, both 0 unless the excess is
-- positive (headroom.py burst_claim).
local function burst_claim(held, average, need, weight, total, capacity)
  if held <= 0 or need <= 0 or (average + need) * total > weight * capacity then
    return 0, 0
  end
  local excess = math.max(0, need - math.max(0, weight * capacity / total - held))
  if excess > 0 then return need, excess end
  return 0, 0
end

-- The other holders' burst claims of `pool` at NOW, summed in actb's order (score, name):
-- excess, claims; stopping once the excess is above `limit` (active.py
-- ActiveTenants.claims): only the holders whose claim may hold at this share (score <=
-- pool / total) are visited, and at most CLAIM_VISITS of them (headroom.py CLAIM_VISITS).
local CLAIM_VISITS = 16
local function claims_of(tenant, pool, total, limit, window)
  local bound = fmt(pool / total * (1 + 1e-9))
  local excess, claims, visits = 0, 0, 0
  -- One more than the visits: the asking tenant may be among them (it is not counted).
  local batch = redis.call('ZRANGEBYSCORE', K_ACTB, '-inf', bound, 'LIMIT', 0, CLAIM_VISITS + 1)
  for _, name in ipairs(batch) do
    if visits == CLAIM_VISITS then break end
    if name ~= tenant then
      visits = visits + 1
      local a = activity(name)
      if a then
        local claim, more = burst_claim(a.h, average_at(a, a.h, window), a.b, a.w, total, pool)
        excess, claims = excess + more, claims + claim
      end
      if excess > limit then break end
    end
  end
  return excess, claims
end

-- ---- leases -----------------------------------------------------------------------------
-- ---- prefix blocks held by leases (gateway/core/prefix.py PrefixHolds) -----------------
-- An engine's reserved blocks are its leases' private blocks plus the distinct prefix
-- blocks they hold; a lease's private part is its blocks + credit - #prefix.

-- How many of `hashes`, from the first, live leases on `engine` hold.
local function held_prefix(engine, hashes)
  local n = 0
  for _, h in ipairs(hashes) do
    if redis.call('HEXISTS', K_PFX, engine .. '\0' .. h) == 0 then break end
    n = n + 1
  end
  return n
end

-- A lease on `engine` holds `hashes` now: how many no lease held before.
local function hold_prefix(engine, hashes)
  local new = 0
  for j, h in ipairs(hashes) do
    if hincrby(K_PFX, engine .. '\0' .. h, 1) == 1 then new = new + 1 end
    if j == 1 then zadd(K_PFH, 0, h .. '\0' .. engine) end -- the holders (`holders`)
  end
  return new
end

-- A lease that held `hashes` on `engine` ended: how many no lease holds now.
local function drop_prefix(engine, hashes)
  local freed = 0
  for j, h in ipairs(hashes) do
    local f = engine .. '\0' .. h
    local left = redis.call('HINCRBY', K_PFX, f, -1) -- a field made here goes at once
    if left <= 0 then
      redis.call('HDEL', K_PFX, f)
      if j == 1 then redis.call('ZREM', K_PFH, h .. '\0' .. engine) end
      if left == 0 then freed = freed + 1 end
    end
  end
  return freed
end

-- ---- engines kept ordered per group (gateway/core/engine_order.py; issue 14) ----------
-- Each group's engines that could take a one-sequence request are members of gord, ranked
-- in lex order by (most free blocks, fewest running, kind, name); every change of an
-- engine's load (`load_add`) or view (`set_views`) moves it in each of its groups (`reorder`),
-- with the group's sums of capacity and free blocks kept by difference. The helpers are the
-- fields of `eng` (a script prepended with this file has at most 200 locals).
local eng = {}

-- The engines where live leases hold a prefix beginning with `h` (hex).
function eng.holders(h)
  local out = {}
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_PFH, '[' .. h .. '\0', '(' .. h .. '\1')) do
    out[#out + 1] = string.sub(m, #h + 2)
  end
  return out
end

-- An engine's view as pushed (views hash), nil without one.
function eng.view_of(name)
  local raw = redis.call('HGET', K_VIEWS, name)
  if not raw then return nil end
  local u, q, st, fb, fs, ok = string.match(raw, '^([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),(.)$')
  return {
    usable = tonumber(u), seqs = tonumber(q), staged = tonumber(st), fb = tonumber(fb),
    fs = tonumber(fs), healthy = ok == '1',
  }
end

-- A group's KV ceiling, nil when the group is not set (or its keys expired).
function eng.group_ceiling(g)
  local c = ceilings[g]
  if c == nil then
    c = tonumber(redis.call('HGET', K_GRP, g)) or false
    ceilings[g] = c
  end
  return c or nil
end

-- The rank part of a member: ascending lex order is (most free, fewest running, kind).
function eng.rank_of(free, running, kind)
  return string.format('%012.0f%07.0f%05.0f', 1e11 - free, running, kind)
end
eng.RANK_LEN = 24

-- Whether the queued entry `e` wants any engine of `engines` (name -> true). Its engines
-- are one string, '\n' between: every other reader of an entry wants only its tags, and
-- cjson decodes an entry of 100 engines in 2.1 µs so, 4.5 µs with them as a list (which
-- an entry written by an older version still has).
function eng.wanted(e, engines)
  if type(e.e) == 'table' then
    for _, name in ipairs(e.e) do
      if engines[name] then return true end
    end
    return false
  end
  for name in string.gmatch(e.e, '[^\n]+') do
    if engines[name] then return true end
  end
  return false
end

-- free, running, kind and name of a member of group `g`.
function eng.parse_member(g, m)
  local at = #g + 2
  return 1e11 - tonumber(string.sub(m, at, at + 11)), tonumber(string.sub(m, at + 12, at + 18)),
    tonumber(string.sub(m, at + 19, at + 23)), string.sub(m, at + eng.RANK_LEN + 1)
end

-- A kind of group `g` (engines alike in all a decision reads but their load): {cap, seqs,
-- staged}.
function eng.kind_info(g, kind)
  local key = g .. '\0' .. kind
  local k = kinds[key]
  if k == nil then
    local raw = redis.call('HGET', K_GRP, g .. ':K:' .. kind)
    local cap, q, st = string.match(raw, '^([^,]+),([^,]+),([^,]+)$')
    k = {cap = tonumber(cap), seqs = tonumber(q), staged = tonumber(st)}
    kinds[key] = k
  end
  return k
end

function eng.kind_of(g, spec)
  local got = redis.call('HGET', K_GRP, g .. ':k:' .. spec)
  if got then return tonumber(got) end
  local n = hincrby(K_GRP, g .. ':kn', 1) - 1
  hset(K_GRP, g .. ':k:' .. spec, n, g .. ':K:' .. n, spec)
  return n
end

-- The smallest capacity among the group's engines with a view (0: none).
function eng.min_capacity(g)
  local least = nil
  for kind = 0, num(redis.call('HGET', K_GRP, g .. ':kn')) - 1 do
    if num(redis.call('HGET', K_GRP, g .. ':kc:' .. kind)) > 0 then
      local cap = eng.kind_info(g, kind).cap
      if least == nil or cap < least then least = cap end
    end
  end
  return least or 0
end

-- The groups' last use (gused, key 24 of the call; read as ALL_KEYS[eng.USED], not as a
-- K_ local: a script prepended with this file is at the 200 locals): a grouped ask or a
-- `set_group` stamps its group; renew.lua drops a group not stamped for a key TTL.
eng.USED = 24

function eng.stamp(g)
  zadd(ALL_KEYS[eng.USED], NOW, g)
end

-- Everything of group `g` goes: its engines' places (and it from their groups in eg), its
-- kinds, its sums, its order and its stamp.
function eng.drop(g)
  local members = redis.call('HGET', K_GRP, g .. ':m')
  if members then
    for name in string.gmatch(members, '[^\n]+') do
      redis.call('HDEL', K_GRP, g .. '\0' .. name)
      local groups = redis.call('HGET', K_EG, name)
      if groups then
        local keep = {}
        for h in string.gmatch(groups, '[^\n]+') do
          if h ~= g then keep[#keep + 1] = h end
        end
        if #keep > 0 then
          redis.call('HSET', K_EG, name, table.concat(keep, '\n'))
        else
          redis.call('HDEL', K_EG, name)
        end
      end
    end
  end
  for kind = 0, num(redis.call('HGET', K_GRP, g .. ':kn')) - 1 do
    local spec = redis.call('HGET', K_GRP, g .. ':K:' .. kind)
    redis.call('HDEL', K_GRP, g .. ':K:' .. kind, g .. ':kc:' .. kind)
    if spec then redis.call('HDEL', K_GRP, g .. ':k:' .. spec) end
  end
  redis.call('HDEL', K_GRP, g, g .. ':m', g .. ':c', g .. ':f', g .. ':n', g .. ':kn')
  redis.call('ZREMRANGEBYLEX', K_GORD, '[' .. g .. '\0', '(' .. g .. '\1')
  redis.call('ZREM', ALL_KEYS[eng.USED], g)
  ceilings[g], kinds = false, {}
end

-- Drop at most `n` of the groups no grouped ask or `set_group` stamped for `idle` seconds
-- (a group is O(its engines) commands to drop: one per call keeps a call short).
function eng.sweep(idle, n)
  local stale = redis.call('ZRANGEBYSCORE', ALL_KEYS[eng.USED], '-inf', NOW - idle,
    'LIMIT', 0, n)
  for _, g in ipairs(stale) do eng.drop(g) end
end

-- Engine `name` of group `g` (ceiling `ceiling`) has view `v` (nil: none) and the load
-- `b` blocks, `s` sequences: its place in gord and the group's sums.
function eng.place(g, ceiling, name, v, b, s)
  local f = g .. '\0' .. name
  local old = redis.call('HGET', K_GRP, f)
  local o_spec, o_cap, o_free, o_kind, o_member
  if old then
    local sp, fr, k, m = string.match(old, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
    o_spec, o_free, o_kind, o_member = sp, tonumber(fr), tonumber(k), m
    o_cap = tonumber(string.match(sp, '^[^,]+'))
  end
  if v == nil then
    if old then
      add(K_GRP, g .. ':c', -o_cap)
      add(K_GRP, g .. ':f', -o_free)
      add(K_GRP, g .. ':n', -1)
      add(K_GRP, g .. ':kc:' .. o_kind, -1)
      redis.call('HDEL', K_GRP, f)
      if o_member ~= '' then redis.call('ZREM', K_GORD, o_member) end
    end
    return
  end
  local cap = math.floor(v.usable * ceiling) -- EngineSpec.capacity_blocks
  local spec = cap .. ',' .. v.seqs .. ',' .. v.staged
  local kind = spec == o_spec and o_kind or eng.kind_of(g, spec)
  local free = cap - b - v.fb
  local clipped = free > 0 and free or 0
  local running = s + v.fs
  local member = ''
  if v.healthy and v.seqs + v.staged > running then
    member = g .. '\0' .. eng.rank_of(free, running, kind) .. '\0' .. name
  end
  if old then
    if member == o_member and spec == o_spec and clipped == o_free then
      return
    end
    add(K_GRP, g .. ':c', cap - o_cap)
    add(K_GRP, g .. ':f', clipped - o_free)
    if kind ~= o_kind then
      add(K_GRP, g .. ':kc:' .. o_kind, -1)
      add(K_GRP, g .. ':kc:' .. kind, 1)
    end
  else
    add(K_GRP, g .. ':c', cap)
    add(K_GRP, g .. ':f', clipped)
    add(K_GRP, g .. ':n', 1)
    add(K_GRP, g .. ':kc:' .. kind, 1)
  end
  -- The new member before the old one goes: a group of one engine keeps its key (and TTL).
  if member ~= '' and member ~= o_member then
    if old and o_member ~= '' then -- the key holds the old member: not made here
      redis.call('ZADD', K_GORD, 0, member)
    else
      zadd(K_GORD, 0, member)
    end
  end
  if old and o_member ~= '' and o_member ~= member then redis.call('ZREM', K_GORD, o_member) end
  hset(K_GRP, f, spec .. '|' .. clipped .. '|' .. kind .. '|' .. member)
end

-- Engine `name`'s load or view changed: move it in each of its groups.
-- `b`, `s`: its reserved blocks and sequences now, when the caller knows them.
local function reorder(name, b, s)
  local groups = redis.call('HGET', K_EG, name)
  if not groups then return end
  local v = eng.view_of(name)
  if b == nil or s == nil then
    local load = redis.call('HMGET', K_LOAD, 'b:' .. name, 's:' .. name)
    b, s = num(load[1]), num(load[2])
  end
  for g in string.gmatch(groups, '[^\n]+') do
    local ceiling = eng.group_ceiling(g)
    if ceiling then eng.place(g, ceiling, name, v, b, s) end
  end
end

-- Reserve (or, negative, give back) blocks, sequences and prompt blocks on an engine.
local function load_add(engine, b, s, p)
  local b_now = add(K_LOAD, 'b:' .. engine, b)
  local s_now = add(K_LOAD, 's:' .. engine, s)
  add(K_LOAD, 'p:' .. engine, p)
  reorder(engine, b_now, s_now)
end

-- A lease's `v` (its blocks or its prompt blocks) less the prefix blocks it shares.
local function private(l, v)
  return math.max(0, v + (l.c or 0) - (l.h and #l.h or 0))
end

local function drop_lease(id, used)
  local raw = redis.call('HGET', K_LEASES, id)
  redis.call('ZREM', K_LEXP, id)
  if not raw then return nil end
  redis.call('HDEL', K_LEASES, id)
  local l = cjson.decode(raw)
  local held = num(redis.call('HGET', K_TEN, 'k:' .. l.t))
  local rec = observe(l.t, nil, held, nil)
  local freed = l.h and drop_prefix(l.e, l.h) or 0
  load_add(l.e, -(private(l, l.b) + freed), -l.s, -(private(l, l.pb or 0) + freed))
  add(K_TEN, 'n:' .. l.t, -1)
  add(K_TEN, 'k:' .. l.t, -l.b)
  if used ~= nil and present(l.tpm) and used ~= l.k then
    local level = bucket_level(l.t, 't', l.tpm) + (l.k - used)
    bucket_set(l.t, 't', l.tpm, math.max(-l.tpm, math.min(l.tpm, level)))
  end
  settle(l.t, rec, held - l.b)
  released = true
  return l
end

local function reap_leases()
  local ids = redis.call('ZRANGEBYSCORE', K_LEXP, '-inf', NOW, 'LIMIT', 0, 500)
  for _, id in ipairs(ids) do drop_lease(id, nil) end
end

-- ---- the fair line (gateway/core/fairqueue.py) ----------------------------------------
local function pkey(prio)
  return string.format('%010d', 1000000000 - prio)
end

local function member(prio, start, seq, id)
  return pkey(prio) .. ':' .. string.format('%024.6f', start) .. ':' .. seq .. ':' .. id
end

local function member_id(m)
  return string.match(m, '^%d+:[%d%.]+:%d+:(.*)$')
end

local function fair_get(field)
  local v = fair[field]
  if v == nil then
    v = redis.call('HGET', K_FAIR, field)
    fair[field] = v
  end
  return v or nil
end

local function fair_num(field)
  return num(fair_get(field))
end

-- Not written when it holds that value already (V and the held V are often unchanged).
local function fair_set(field, value)
  if fair[field] == value then return end
  hset(K_FAIR, field, value)
  fair[field] = value
end

local function fair_del(field)
  redis.call('HDEL', K_FAIR, field)
  fair[field] = false
end

local function entry(id)
  local raw = redis.call('HGET', K_QENT, id)
  if not raw then return nil end
  return cjson.decode(raw)
end

-- The tenant's entries of class `prio` joined, left or moved.
local function line_changed(tenant, prio)
  firstq[prio], lastq[tenant .. '\0' .. prio], vnow[prio] = nil, nil, nil
end

-- The start tag of the first entry of class `prio` (nil: nobody queued in it).
local function first_start(prio)
  local s = firstq[prio]
  if s == nil then
    local p = pkey(prio)
    local first = redis.call('ZRANGEBYLEX', K_Q, '[' .. p .. ':', '(' .. p .. ';', 'LIMIT', 0, 1)[1]
    s = first and tonumber(entry(member_id(first)).s) or false
    firstq[prio] = s
  end
  return s or nil
end

-- The finish tag of the tenant's last entry of class `prio` (nil: none queued).
local function last_queued_finish(tenant, prio)
  local key = tenant .. '\0' .. prio
  local f = lastq[key]
  if f == nil then
    local p = tenant .. '\0' .. pkey(prio)
    local last = redis.call('ZREVRANGEBYLEX', K_QTF, '(' .. p .. ';', '[' .. p .. ':', 'LIMIT', 0, 1)[1]
    f = last and tonumber(entry(member_id(string.sub(last, #tenant + 2))).f) or false
    lastq[key] = f
  end
  return f or nil
end

local function virtual_now(prio)
  local cached = vnow[prio]
  if cached then return cached end
  local v = math.max(fair_num('vf:' .. prio), first_start(prio) or fair_num('v:' .. prio))
  vnow[prio] = v
  return v
end

local function last_finish(tenant, prio)
  local served = fair_num('f:' .. prio .. ':' .. tenant)
  local queued = last_queued_finish(tenant, prio)
  if queued then return math.max(served, queued) end
  return served
end

-- max(V - B / weight, F_t): a tenant behind its share starts up to `burst` blocks early.
local function start_tag(tenant, prio, weight, burst)
  return math.max(virtual_now(prio) - burst / weight, last_finish(tenant, prio))
end

-- Record V before the line changes: whatever joins or leaves, V never goes back.
local function hold_v(prio)
  fair_set('vf:' .. prio, fmt(virtual_now(prio)))
end

-- The start tag for a new charge (recording the V it used).
local function tag(tenant, prio, weight, burst)
  hold_v(prio)
  return start_tag(tenant, prio, weight, burst)
end

-- An entry is kept alive like a lease: it expires at its deadline, or `lease_ttl` after its
-- replica last renewed it, whichever comes first (a dead replica's waiters leave the line).
local function push(id, tenant, prio, weight, engines, blocks, deadline, owner, lease_ttl, burst)
  local start = tag(tenant, prio, weight, burst)
  local seq = string.format('%016d', hincrby(K_FAIR, 'seq', 1))
  local m = member(prio, start, seq, id)
  local q = tenant .. '\0' .. m
  zadd(K_Q, 0, m)
  zadd(K_QTF, 0, q)
  line_changed(tenant, prio)
  zadd(K_QEXP, math.min(deadline, NOW + lease_ttl), id)
  hset(K_QENT, id, cjson.encode({
    m = m, q = q, t = tenant, p = prio, b = blocks, e = table.concat(engines, '\n'),
    s = fmt(start), f = fmt(start + blocks / weight), r = owner, d = fmt(deadline),
  }))
end

-- The entry's replica is alive: it stays `lease_ttl` more, never past its deadline.
-- Returns false when the entry is gone (served, left, or reaped).
local function renew_entry(id, lease_ttl)
  local e = entry(id)
  if not e then return false end
  local deadline = tonumber(e.d) or (NOW + lease_ttl)
  redis.call('ZADD', K_QEXP, 'XX', math.min(deadline, NOW + lease_ttl), id)
  return true
end

-- Move the tenant's entries after `e` (same class) back by e's charge, never before e's
-- start: an entry that leaves unserved leaves no hole in the tenant's run of tags. The
-- first of them (it moved up the most) looks again (`moved`).
local function close_gap(e)
  local charge = tonumber(e.f) - tonumber(e.s)
  local p = e.t .. '\0' .. pkey(e.p)
  for i, q in ipairs(redis.call('ZRANGEBYLEX', K_QTF, '(' .. e.q, '(' .. p .. ';')) do
    local id = member_id(string.sub(q, #e.t + 2))
    if i == 1 then moved[#moved + 1] = id end
    local x = entry(id)
    local s, f = tonumber(x.s), tonumber(x.f)
    local start = math.max(tonumber(e.s), s - charge)
    if start ~= s then
      local seq = string.match(x.m, '^%d+:[%d%.]+:(%d+):')
      redis.call('ZREM', K_Q, x.m)
      redis.call('ZREM', K_QTF, x.q)
      x.m = member(x.p, start, seq, id)
      x.q = x.t .. '\0' .. x.m
      x.s, x.f = fmt(start), fmt(start + (f - s))
      zadd(K_Q, 0, x.m)
      zadd(K_QTF, 0, x.q)
      line_changed(x.t, x.p)
      hset(K_QENT, id, cjson.encode(x))
    end
  end
end

-- Take an entry off the line; `served` false: it left unserved (timeout, client gone).
local function leave(id, served)
  local e = entry(id)
  redis.call('ZREM', K_QEXP, id)
  if not e then return nil end
  hold_v(e.p) -- whatever leaves, V never goes back
  redis.call('HDEL', K_QENT, id)
  redis.call('ZREM', K_Q, e.m)
  redis.call('ZREM', K_QTF, e.q)
  line_changed(e.t, e.p)
  if not served then close_gap(e) end
  settle(e.t, nil)
  departed[#departed + 1] = id
  return e
end

-- Served tags that can no longer matter are forgotten (fairqueue.py `_prune`): a few at
-- each write, the first horizons of fairh, while V of their class has passed them.
local PRUNE_BATCH, MARGIN = 4, 1e-9

local function prune_tags()
  for _ = 1, PRUNE_BATCH do
    local first = redis.call('ZRANGE', K_FAIRH, 0, 0, 'WITHSCORES')
    if #first == 0 then return end
    local prio, tenant = string.match(first[1], '^(-?%d+):(.*)$')
    if tonumber(first[2]) > virtual_now(tonumber(prio)) then return end
    redis.call('ZREM', K_FAIRH, first[1])
    fair_del('f:' .. prio .. ':' .. tenant)
  end
end

-- The tenant's served finish tag is `finish`; `weight` and `burst` (nil: unknown) say when
-- it stops mattering.
local function set_served(tenant, prio, finish, weight, burst)
  local m = prio .. ':' .. tenant
  fair_set('f:' .. m, fmt(finish))
  if weight and burst then
    zadd(K_FAIRH, fmt((finish + burst / weight) * (1 + MARGIN) + MARGIN), m)
  else
    redis.call('ZREM', K_FAIRH, m) -- kept until a write that knows them
  end
  prune_tags()
end

local function remember(tenant, prio, start, finish, weight, burst)
  local v = 'v:' .. prio
  fair_set(v, fmt(math.max(fair_num(v), start)))
  vnow[prio] = nil
  local served = fair_get('f:' .. prio .. ':' .. tenant)
  if not served or finish > tonumber(served) then
    set_served(tenant, prio, finish, weight, burst)
  else
    prune_tags()
  end
end

local function serve(id, burst)
  local e = leave(id, true)
  if e then
    local s, f, b = tonumber(e.s), tonumber(e.f), tonumber(e.b)
    local weight = (b > 0 and f > s) and b / (f - s) or nil -- its charge is blocks / weight
    remember(e.t, e.p, s, f, weight, burst)
  end
  return e
end

local function charge(tenant, prio, weight, blocks, burst)
  local start = tag(tenant, prio, weight, burst)
  remember(tenant, prio, start, start + blocks / weight, weight, burst)
end

-- Entries whose time is up leave unserved, in line order (fairqueue.py `expire`): V is held
-- before each, so the order decides where V ends. (In the order of their expiry, V could end
-- behind the in-process line's: tests/state/test_lua_differential.py, issue 39.)
local function expire_queue()
  local ids = redis.call('ZRANGEBYSCORE', K_QEXP, '-inf', NOW, 'LIMIT', 0, 500)
  if #ids > 1 then
    local due = {}
    for i, id in ipairs(ids) do
      local e = entry(id)
      due[i] = {id = id, m = e and e.m or ''}
    end
    table.sort(due, function(a, b) return a.m < b.m end)
    for i, d in ipairs(due) do ids[i] = d.id end
  end
  for _, id in ipairs(ids) do leave(id, false) end
end

-- The nearest entry ordered before `key` (a member string) that competes for any engine
-- in the set `engines` (engine -> true), with its id; nil when none does. `own` is the
-- asker's own entry id. Entries for which `passable(entry)` is true do not count
-- (headroom). Looks back from `key` (fairqueue.py `blocker`).
-- Read back in batches of 4, 16, 64, then 100: the entry just ahead mostly competes.
local function blocker(key, engines, own, passable)
  local offset, size = 0, 4
  while true do
    local batch = redis.call('ZREVRANGEBYLEX', K_Q, '(' .. key, '-', 'LIMIT', offset, size)
    for _, m in ipairs(batch) do
      local id = member_id(m)
      if id ~= own then
        local e = entry(id)
        if eng.wanted(e, engines) and (passable == nil or not passable(e)) then return e, id end
      end
    end
    if #batch < size then return nil end
    offset = offset + size
    size = math.min(100, size * 4)
  end
end

-- ---- housekeeping -----------------------------------------------------------------------
-- Every key gets a TTL; a script never shortens one (a long queue wait may have set more).
-- The active tenants' records and their aggregates (11, 13, 14, 15, 17) share the longest of
-- their TTLs: they expire together or not at all. A TTL less than 1 % of the key TTL short
-- of what it should be (1.3 s of 130 s) is left alone: a key is set again about once a
-- second, not by every call (each PEXPIRE a command of its own inside the script).
-- A full touch reads the TTLs of all the keys but the clock (the last), so it runs once per
-- 1 % of the key TTL; meanwhile a call reads the TTLs of only the keys it may have created
-- (`made`): every key then keeps at least the key TTL less 2 %, and none is ever without one.
local SHARED_TTL = {[11] = true, [13] = true, [14] = true, [15] = true, [17] = true}

local function is_shared(key)
  for i in pairs(SHARED_TTL) do
    if ALL_KEYS[i] == key then return true end
  end
  return false
end

local function full_touch(ttl_ms, slack)
  local cur, shared, stale = {}, ttl_ms, false
  local data = #ALL_KEYS - 1
  for i = 1, data do
    cur[i] = redis.call('PTTL', ALL_KEYS[i])
    if SHARED_TTL[i] and cur[i] > shared then shared = cur[i] end
  end
  for i in pairs(SHARED_TTL) do
    if cur[i] ~= -2 and cur[i] < shared - slack then stale = true end
  end
  for i = 1, data do
    if cur[i] ~= -2 then
      if SHARED_TTL[i] then
        if stale and cur[i] < shared then redis.call('PEXPIRE', ALL_KEYS[i], shared) end
      elseif cur[i] < ttl_ms - slack then
        redis.call('PEXPIRE', ALL_KEYS[i], ttl_ms)
      end
    end
  end
  redis.call('SET', K_TOUCH, '1', 'PX', math.max(1, slack))
end

-- The keys this call may have created get their TTL; a records' key made anew takes the
-- TTL the other three have (the key TTL when none has one).
local function touch_made(ttl_ms)
  local shared
  for key in pairs(made) do
    if redis.call('PTTL', key) == -1 then
      if is_shared(key) then
        if shared == nil then
          shared = 0
          for i in pairs(SHARED_TTL) do
            shared = math.max(shared, redis.call('PTTL', ALL_KEYS[i]))
          end
          if shared <= 0 then shared = ttl_ms end
        end
        redis.call('PEXPIRE', key, shared)
      else
        redis.call('PEXPIRE', key, ttl_ms)
      end
    end
  end
end

-- A TTL longer than the key TTL (a long queue wait) always takes the full touch.
local function touch(ttl_ms)
  local slack = math.floor(KEY_TTL_MS / 100)
  if ttl_ms <= KEY_TTL_MS and redis.call('EXISTS', K_TOUCH) == 1 then
    return touch_made(ttl_ms)
  end
  full_touch(ttl_ms, slack)
end

-- Change notices are for waiters, and every waiter has an entry in the line: with nobody
-- queued there is nobody to wake (a release then costs no message to every replica).
-- One message, lines: 'c' capacity freed (wakes the waiters not behind anyone), 'd:<id>'
-- the entry left the line (wakes those behind it), 'w:<id>' the entry moved up (wakes its
-- own waiter). Targeted: a release wakes the front of the line, not every waiter.
local function finish(reply)
  touch(KEY_TTL_MS)
  if (released or #departed > 0 or #moved > 0) and redis.call('ZCARD', K_QEXP) > 0 then
    local lines = {}
    if released then lines[1] = 'c' end
    for _, id in ipairs(departed) do lines[#lines + 1] = 'd:' .. id end
    for _, id in ipairs(moved) do lines[#lines + 1] = 'w:' .. id end
    redis.call('PUBLISH', CHANNEL, table.concat(lines, '\n'))
  end
  return reply
end
