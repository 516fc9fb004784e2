-- try_admit: tenant limits, the fair order, engine capacity and choice, the lease write.
-- ARGV: 3 lease id, 4 replica, 5 lease ttl s, 6 tenant, 7 priority, 8 weight,
--   9 max concurrency, 10 rpm, 11 tpm, 12 tenant max blocks ('' = no limit), 13 tokens,
--   14 queued '1'/'0', 15 tie-break seed ('' = Redis TIME microseconds), 16 scorers (csv),
--   17 the line's burst credit in blocks, 18 headroom (fraction, 0 = off), 19 the active
--   window s, 20 candidate count, 21 the cached block weight (most_free_after), then per
--   candidate 11 values: name, capacity blocks at
--   the ceiling, sequence slots (max_num_seqs + staged), foreign blocks, foreign seqs,
--   healthy '1'/'0', need blocks, need seqs, need prompt blocks, its prefix (the number of
--   a list below, 0 = none), blocks the engine is expected to cache (the replica's index);
--   then the number of prefix lists, and each list as its length and its hashes (hex).
--   Free capacity is what the ledger leaves after the foreign load
--   (gateway/core/types.py EngineView): capacity − reserved − foreign. A candidate's need
--   is credited with the leading blocks of its prefix that live leases on its engine hold.
-- Reply: {'lease', engine, blocks, seqs, rpm level, tpm level, now, prompt blocks, credit}
--        (levels after this request, '' without that limit)
--        | {'refused', code, retry_after_s or '', for queued_ahead: the entry it waits behind,
--           seconds until that entry's expiry, '1' if it may pass it later (headroom)}
--        | {'exists', engine, blocks, seqs, replica, prompt blocks, credit}
local id, replica, lease_ttl = ARGV[3], ARGV[4], tonumber(ARGV[5])
local tenant, prio, weight = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local max_conc, rpm, tpm = opt(ARGV[9]), opt(ARGV[10]), opt(ARGV[11])
local max_blocks, tokens, queued = opt(ARGV[12]), tonumber(ARGV[13]), ARGV[14] == '1'
local seed = opt(ARGV[15]) or USEC
local burst = tonumber(ARGV[17])
local headroom, window = tonumber(ARGV[18]), tonumber(ARGV[19])

reap_leases()
expire_queue()

local existing = redis.call('HGET', K_LEASES, id)
if existing then
  local l = cjson.decode(existing)
  return finish({'exists', l.e, l.b, l.s, l.r, l.pb or 0, l.c or 0})
end

local function refuse(code, retry)
  return finish({'refused', code, retry and fmt(retry) or ''})
end

-- Tenant limits: concurrency, then requests per minute, then tokens per minute.
if max_conc and num(redis.call('HGET', K_TEN, 'n:' .. tenant)) + 1 > max_conc then
  return refuse('tenant_concurrency')
end
local rpm_level, tpm_level
if rpm then
  rpm_level = bucket_level(tenant, 'r', rpm)
  if rpm_level < 1 then
    return refuse('tenant_rpm', rpm >= 1 and seconds_until(1, rpm_level, rpm) or nil)
  end
end
if tpm then
  tpm_level = bucket_level(tenant, 't', tpm)
  if tpm_level < tokens then
    local ok = tpm >= 1 and tokens <= tpm
    return refuse('tenant_tpm', ok and seconds_until(tokens, tpm_level, tpm) or nil)
  end
end

-- Candidates within the tenant's KV share.
local scorers = {}
for name in string.gmatch(ARGV[16], '[^,]+') do scorers[#scorers + 1] = name end
local count = tonumber(ARGV[20])
local cached_weight = tonumber(ARGV[21])
local lists, at = {}, 22 + count * 11
for j = 1, tonumber(ARGV[at]) do
  local n, list = tonumber(ARGV[at + 1]), {}
  for k = 1, n do list[k] = ARGV[at + 1 + k] end
  lists[j] = list
  at = at + 1 + n
end
local held = num(redis.call('HGET', K_TEN, 'k:' .. tenant))
local engines, within, pool, need = {}, {}, 0, 0
local fields = {} -- the loads of the candidates within the share: 'b:<name>', 's:<name>'
for i = 0, count - 1 do
  local base = 22 + i * 11
  local name, b = ARGV[base], tonumber(ARGV[base + 6])
  local cap, h = tonumber(ARGV[base + 1]), lists[tonumber(ARGV[base + 9])]
  local c = {
    name = name, cap = cap, max_seqs = tonumber(ARGV[base + 2]),
    for_b = tonumber(ARGV[base + 3]), for_s = tonumber(ARGV[base + 4]),
    healthy = ARGV[base + 5] == '1', b = b, s = tonumber(ARGV[base + 7]),
    pb = tonumber(ARGV[base + 8]), h = h, cached = tonumber(ARGV[base + 10]), cr = 0,
  }
  if b > need then need = b end -- the headroom rule's, before credit
  if h then
    c.cr = held_prefix(name, h)
    c.b, c.pb = b - c.cr, math.max(0, c.pb - c.cr)
    c.cached = math.max(c.cached, c.cr)
  end
  engines[name] = true
  pool = pool + cap
  if max_blocks == nil or held + c.b <= max_blocks then
    within[#within + 1] = c
    fields[#fields + 1] = 'b:' .. name
    fields[#fields + 1] = 's:' .. name
  end
end
if count > 0 and #within == 0 then return refuse('tenant_kv_share') end

-- Headroom (gateway/core/headroom.py): the active tenants, the others' weights, from the
-- aggregates kept as they change (common.lua, active_now).
local rule = nil
if headroom > 0 then
  local t = active_now(window)
  local rec = activity(tenant)
  local others = others_weight(t, rec)
  if others > 0 then
    local total = weight + others
    local mine = average_at(rec, held, window)
    -- What the other active tenants lack of their shares of the pool: kept free for them.
    rule = {total = total, mine = mine, unused = unused_of(t, tenant, rec, others, pool, total)}
    -- A queued entry this ask may pass: the ask stays within its share, and the entry
    -- would take its (other) tenant above its own.
    if not over_share(held, need, mine, weight, total, pool) then
      local seen = {}
      rule.passable = function(e)
        if e.t == tenant then return false end
        local a = seen[e.t]
        if a == nil then
          a = activity(e.t) or false
          seen[e.t] = a
        end
        if not a then return false end
        return over_share(a.h, e.b, average_at(a, a.h, window), a.w, total, pool)
      end
    end
  end
end

-- The order of the line: nobody queued before this ask may want any of its engines.
local own = queued and entry(id) or nil
local key = own and own.m or member(prio, start_tag(tenant, prio, weight, burst), NEWCOMER_SEQ, '')
local ahead, ahead_id = blocker(key, engines, id, rule and rule.passable)
if ahead then
  local expires = tonumber(redis.call('ZSCORE', K_QEXP, ahead_id)) or NOW
  return finish({'refused', 'queued_ahead', '', ahead_id, fmt(math.max(0, expires - NOW)),
    (rule and ahead.t ~= tenant and num(redis.call('HGET', K_TEN, 'k:' .. ahead.t)) > 0)
      and '1' or '0'})
end

-- Routing (gateway/core/routing.py): filter, score, then a seeded choice among ties.
local pool_free = 0
for first = 1, #within, 500 do -- one HMGET per 500 engines (unpack's limit is far above)
  local last = math.min(#within, first + 499)
  local loads = redis.call('HMGET', K_LOAD, unpack(fields, 2 * first - 1, 2 * last))
  for i = first, last do
    local c, at = within[i], 2 * (i - first)
    local res_b = tonumber(loads[at + 1]) or 0
    c.res_b, c.res_s = res_b, tonumber(loads[at + 2]) or 0
    local free = c.cap - res_b - c.for_b
    if free > 0 then pool_free = pool_free + free end
  end
end
local nscore = #scorers
local best, ties, score = nil, {}, {}
for _, c in ipairs(within) do
  local free = c.cap - c.res_b - c.for_b
  local running = c.res_s + c.for_s
  local room = c.healthy and c.b <= free and c.s <= c.max_seqs - running
  if room and rule then
    if rule.excess == nil then
      rule.excess, rule.claims = claims_of(tenant, pool, rule.total, pool_free, window)
    end
    local after = pool_free - c.b
    if over_share(held, c.b, rule.mine, weight, rule.total, pool) then
      room = free - c.b >= headroom * c.cap
        and after - rule.excess >= unused_against(rule.unused, after - rule.excess)
    elseif held > 0 and (rule.mine + c.b) * rule.total > weight * pool then
      room = after >= rule.claims -- the others' burst claims (headroom.py allows)
    end
  end
  if room then
    for i = 1, nscore do
      local name = scorers[i]
      if name == 'most_free_blocks' then
        score[i] = free
      elseif name == 'most_free_after' then
        score[i] = free - c.b + cached_weight * c.cached -- c.cached >= c.cr
      elseif name == 'fewest_running' then
        score[i] = -running
      elseif name == 'lowest_kv_fraction' then
        score[i] = c.cap <= 0 and -1 or 1 - (c.cap - free) / c.cap
      else
        return redis.error_reply('unknown scorer ' .. name)
      end
    end
    local cmp = 0
    if best then
      for i = 1, nscore do
        if score[i] ~= best[i] then
          cmp = score[i] > best[i] and 1 or -1
          break
        end
      end
    end
    if best == nil or cmp > 0 then
      best, score, ties = score, best or {}, {c} -- the old best's table takes the next score
    elseif cmp == 0 then
      ties[#ties + 1] = c
    end
  end
end
if best == nil then return refuse('no_capacity') end
local chosen = ties[(seed % #ties) + 1]

-- The lease, the counters, the charges.
local l = {
  e = chosen.name, b = chosen.b, s = chosen.s, pb = chosen.pb, t = tenant, k = tokens, r = replica,
  rpm = rpm, tpm = tpm, p = prio, w = weight,
}
if chosen.h and #chosen.h > 0 then l.h, l.c = chosen.h, chosen.cr end
hset(K_LEASES, id, cjson.encode(l))
zadd(K_LEXP, NOW + lease_ttl, id)
local shared = l.h and hold_prefix(l.e, l.h) or 0
add(K_LOAD, 'b:' .. chosen.name, private(l, l.b) + shared)
add(K_LOAD, 's:' .. chosen.name, chosen.s)
add(K_LOAD, 'p:' .. chosen.name, private(l, l.pb) + shared)
local rec = headroom > 0 and observe(tenant, weight, held, window, chosen.b) or nil
add(K_TEN, 'n:' .. tenant, 1)
add(K_TEN, 'k:' .. tenant, chosen.b)
if rpm then bucket_set(tenant, 'r', rpm, rpm_level - 1) end
if tpm then bucket_set(tenant, 't', tpm, tpm_level - tokens) end
if own then
  serve(id, burst) -- the line moved: those behind may now go
else
  charge(tenant, prio, weight, chosen.b, burst)
end
settle(tenant, rec, held + chosen.b)
return finish({'lease', chosen.name, chosen.b, chosen.s,
  rpm and fmt(rpm_level - 1) or '', tpm and fmt(tpm_level - tokens) or '', fmt(NOW),
  chosen.pb, chosen.cr})
