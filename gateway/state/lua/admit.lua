-- try_admit: tenant limits, the fair order, engine capacity and choice, the lease write.
-- ARGV: 4 lease id, 5 replica, 6 lease ttl s, 7 tenant, 8 priority, 9 weight,
--   10 max concurrency, 11 rpm, 12 tpm, 13 tenant max blocks ('' = no limit), 14 tokens,
--   15 queued '1'/'0', 16 tie-break seed ('' = the clock's microseconds: common.lua
--   `begin`), 17 routing: down to which key the engine order ranks engines as the scorers
--   do ('free', 'running', '' = not: routing.py `Router.ordered_by`), ';', the scorers
--   (csv), as 'running;most_free_after,fewest_running', 18 the line's burst credit in
--   blocks, 19 headroom (fraction, 0 = off), 20 the active window s, 21 candidate count
--   (or 'g': a grouped ask), 22 the cached block weight (most_free_after), then per
--   candidate 11 values: name, capacity blocks at the ceiling, sequence slots (max_num_seqs
--   + staged), foreign blocks, foreign seqs, healthy '1'/'0', need blocks, need seqs, need
--   prompt blocks, its prefix (the number of a list below, 0 = none), blocks the engine is
--   expected to cache (the replica's index); then the number of prefix lists, and each
--   list as its length and its hashes (hex).
--   A grouped ask (issue 14, docs/engine-index.md) has instead: 23 its group, 24 its KV
--   ceiling, 25 staged '1'/'0', 26-30 its common footprint (blocks, seqs, prompt blocks,
--   prefix list, cached blocks), 31 the number of exceptions, then per exception its
--   engine and footprint (6 values); then the prefix lists. The engines are the group's,
--   as `set_views` and `set_group` (engines.lua) gave them; a group that Redis no longer
--   holds (its keys expired) gets the reply {'regroup'}.
--   Free capacity is what the ledger leaves after the foreign load
--   (gateway/core/types.py EngineView): capacity − reserved − foreign. A candidate's need
--   is credited with the leading blocks of its prefix that live leases on its engine hold.
-- Reply: {'lease', engine, blocks, seqs, rpm level, tpm level, now, prompt blocks, credit}
--        (levels after this request, '' without that limit)
--        | {'refused', code, retry_after_s or '', for queued_ahead: the entry it waits behind,
--           seconds until that entry's expiry, '1' if it may pass it later (headroom)}
--        | {'exists', engine, blocks, seqs, replica, prompt blocks, credit}
local id, replica, lease_ttl = ARGV[4], ARGV[5], tonumber(ARGV[6])
local tenant, prio, weight = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local max_conc, rpm, tpm = opt(ARGV[10]), opt(ARGV[11]), opt(ARGV[12])
local max_blocks, tokens, queued = opt(ARGV[13]), tonumber(ARGV[14]), ARGV[15] == '1'
local seed = opt(ARGV[16]) or USEC
local burst = tonumber(ARGV[18])
local headroom, window = tonumber(ARGV[19]), tonumber(ARGV[20])

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

local held = num(redis.call('HGET', K_TEN, 'k:' .. tenant))
local own = queued and entry(id) or nil -- this ask's entry in the line
local chosen = nil -- the candidate the lease goes to
do -- the choice (its locals end here: a script prepended with common.lua has at most 200)
  -- 'running' / 'free' when the engine order ranks as the scorers do, else ''.
  local scorers, by_running = {}, string.match(ARGV[17], '^(%a*);')
  for name in string.gmatch(string.sub(ARGV[17], #by_running + 2), '[^,]+') do
    scorers[#scorers + 1] = name
  end
  local nscore = #scorers
  local cached_weight = tonumber(ARGV[22])

  -- The prefix lists (each sent once), after the candidates or the grouped ask's fields.
  local grouped = ARGV[21] == 'g'
  local count = grouped and 0 or tonumber(ARGV[21])
  local lists, at = {}, nil
  local g, ceiling, staged, need_f, exc, sums = nil, nil, nil, nil, {}, nil
  if grouped then
    g, ceiling, staged = ARGV[23], tonumber(ARGV[24]), ARGV[25] == '1'
    local nexc = tonumber(ARGV[31])
    at = 32 + nexc * 6
  else
    at = 23 + count * 11
  end
  for j = 1, tonumber(ARGV[at]) do
    local n, list = tonumber(ARGV[at + 1]), {}
    for k = 1, n do list[k] = ARGV[at + 1 + k] end
    lists[j] = list
    at = at + 1 + n
  end

  -- A candidate: the engine's figures and the request's footprint there.
  local function candidate(name, v, f)
    return {
      name = name, cap = math.floor(v.usable * ceiling),
      max_seqs = v.seqs + (staged and v.staged or 0), for_b = v.fb, for_s = v.fs,
      healthy = v.healthy, b = f.b, s = f.s, pb = f.pb, h = f.h, cached = f.cached, cr = 0,
    }
  end

  -- A candidate's need credited with the leading prefix blocks live leases there hold.
  local function credit(c)
    if c.h then
      c.cr = held_prefix(c.name, c.h)
      c.b, c.pb = c.b - c.cr, math.max(0, c.pb - c.cr)
      c.cached = math.max(c.cached, c.cr)
    end
    return c
  end

  local function within_share(b)
    return max_blocks == nil or held + b <= max_blocks
  end

  local cands = {} -- the ask's candidates, before credit
  if grouped then
    -- The group's ceiling and sums, read once: {ceiling, engines with a view, capacity, free}.
    sums = redis.call('HMGET', K_GRP, g, g .. ':n', g .. ':c', g .. ':f')
    if not sums[1] then return finish({'regroup'}) end
    eng.stamp(g)
    local function footprint(base)
      return {
        b = tonumber(ARGV[base]), s = tonumber(ARGV[base + 1]), pb = tonumber(ARGV[base + 2]),
        h = lists[tonumber(ARGV[base + 3])], cached = tonumber(ARGV[base + 4]),
      }
    end
    need_f = footprint(26)
    for i = 0, tonumber(ARGV[31]) - 1 do
      local base = 32 + i * 6
      exc[#exc + 1] = {name = ARGV[base], f = footprint(base + 1)}
    end
  else
    for i = 0, count - 1 do
      local base = 23 + i * 11
      cands[#cands + 1] = {
        name = ARGV[base], cap = tonumber(ARGV[base + 1]), max_seqs = tonumber(ARGV[base + 2]),
        for_b = tonumber(ARGV[base + 3]), for_s = tonumber(ARGV[base + 4]),
        healthy = ARGV[base + 5] == '1', b = tonumber(ARGV[base + 6]),
        s = tonumber(ARGV[base + 7]), pb = tonumber(ARGV[base + 8]),
        h = lists[tonumber(ARGV[base + 9])], cached = tonumber(ARGV[base + 10]), cr = 0,
      }
    end
  end

  -- Headroom (gateway/core/headroom.py): the active tenants, the others' weights, from the
  -- aggregates kept as they change (common.lua, active_now). `pool` is the candidates'
  -- capacity, `need` their largest footprint (before credit). Returns a function that gives
  -- the rule (nil: none), computed when first asked for: a refusal by the line mostly does
  -- not depend on it (`line_reply`).
  local function headroom_rule(pool, need)
    local rule = false
    local function compute()
      if headroom <= 0 then return nil end
      local t = active_now(window)
      local rec = activity(tenant)
      local others = others_weight(t, rec)
      if others <= 0 then return nil end
      local total = weight + others
      local mine = average_at(rec, held, window)
      local r = {total = total, mine = mine, pool = pool}
      -- What the other active tenants lack of their shares of the pool, kept free for
      -- them: read (`unused_of`) when `allows` first needs it, for an ask above its share.
      local unused = nil
      r.unused = function()
        if unused == nil then unused = unused_of(t, tenant, rec, others, pool, total) end
        return unused
      end
      -- Whether this ask may pass a queued entry of another tenant (`a` that tenant's
      -- record): the ask stays within its share, and the entry would take its tenant above
      -- its own (nil while the ask is above its share: it passes none).
      if not over_share(held, need, mine, weight, total, pool) then
        r.passable = function(e, a)
          return over_share(a.h, e.b, average_at(a, a.h, window), a.w, total, pool)
        end
      end
      return r
    end
    return function()
      if rule == false then rule = compute() end
      return rule
    end
  end

  -- The rule with the pool's free blocks now and the other holders' burst claims.
  local function with_claims(rule, pool_free)
    rule.pool_free = pool_free
    rule.excess, rule.claims = claims_of(tenant, rule.pool, rule.total, pool_free, window)
  end

  -- Whether the rule lets `b` blocks go on an engine of capacity `cap` with `free` blocks.
  local function allows(rule, b, cap, free)
    local after = rule.pool_free - b
    if over_share(held, b, rule.mine, weight, rule.total, rule.pool) then
      return free - b >= headroom * cap
        and after - rule.excess >= unused_against(rule.unused(), after - rule.excess)
    elseif held > 0 and (rule.mine + b) * rule.total > weight * rule.pool then
      return after >= rule.claims -- the others' burst claims (headroom.py allows)
    end
    return true
  end

  -- The order of the line: nobody queued before this ask may want any of its engines
  -- (`engines`: name -> true). A reply when someone does, else nil. `rule_of()` gives the
  -- headroom rule; it is asked for only where it decides: an entry of another tenant that
  -- holds blocks may be passable (one holding none is never above its share).
  local function line_reply(engines, rule_of)
    local key = own and own.m
      or member(prio, start_tag(tenant, prio, weight, burst), NEWCOMER_SEQ, '')
    local passable = nil
    if headroom > 0 then
      passable = function(e)
        if e.t == tenant then return false end
        local a = activity(e.t)
        if not a or (a.h <= 0 and not a.stale) then return false end -- above no share
        local rule = rule_of()
        if not rule or not rule.passable then return false end
        -- Read again: the rule's first computation may have counted the records anew.
        a = activity(e.t)
        return a ~= nil and rule.passable(e, a)
      end
    end
    local ahead, ahead_id = blocker(key, engines, id, passable)
    if not ahead then return nil end
    local expires = tonumber(redis.call('ZSCORE', K_QEXP, ahead_id)) or NOW
    return {'refused', 'queued_ahead', '', ahead_id, fmt(math.max(0, expires - NOW)),
      (ahead.t ~= tenant and num(redis.call('HGET', K_TEN, 'k:' .. ahead.t)) > 0
        and rule_of() ~= nil) and '1' or '0'}
  end

  -- The candidate's score by each scorer, higher is better: a branch for each of routing.py
  -- `SCORERS`, as it scores (tests/state/test_scorers.py).
  local function score_of(c, free, running)
    local score = {}
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
        return nil
      end
    end
    return score
  end

  -- 1 if score a ranks above b, -1 below, 0 equal.
  local function compare(a, b)
    for i = 1, nscore do
      if a[i] ~= b[i] then return a[i] > b[i] and 1 or -1 end
    end
    return 0
  end

  -- The ordered path (memory.py `_choose_ordered`): a grouped ask decided from the group's
  -- order. The exceptions and the engines where live leases hold the request's prefix are
  -- scored one by one; the rest are ranked by gord, so only the engines ranked above the
  -- choice that fail the filter or the headroom rule are read. Returns the chosen
  -- candidate, a reply (refused), or nil where every engine must be scored (as then below).
  local function ordered()
    local present = num(sums[2])
    if by_running == '' or ceiling ~= tonumber(sums[1]) or present == 0 or need_f.s < 1 then
      return nil
    end
    -- The group's engines with a view (name -> true), looked up as they are asked for.
    local members = setmetatable({}, {__index = function(t, name)
      local yes = redis.call('HEXISTS', K_GRP, g .. '\0' .. name) == 1
      rawset(t, name, yes)
      return yes
    end})
    local special, nspecial = {}, 0 -- engine -> footprint
    for _, x in ipairs(exc) do
      if members[x.name] then
        if not special[x.name] then nspecial = nspecial + 1 end
        special[x.name] = x.f
      end
    end
    if nspecial == present then return nil end -- no engine takes `need`
    local worst = need_f.b
    for _, f in pairs(special) do
      if f.b > worst then worst = f.b end
    end
    if need_f.h and #need_f.h > 0 then
      for _, name in ipairs(eng.holders(need_f.h[1])) do
        if not special[name] and members[name] then
          special[name] = need_f
        end
      end
    end
    local ex = {}
    for name, f in pairs(special) do ex[#ex + 1] = credit(candidate(name, eng.view_of(name), f)) end
    if not within_share(need_f.b) then
      for _, c in ipairs(ex) do
        if within_share(c.b) then return nil end
      end
      return {'refused', 'tenant_kv_share', ''}
    end
    for _, c in ipairs(ex) do
      if not within_share(c.b) then return nil end
    end
    local rule_of = headroom_rule(num(sums[3]), worst)
    local reply = line_reply(members, rule_of)
    if reply then return reply end
    local rule = rule_of()
    local floor, over = need_f.b, false
    if rule then
      with_claims(rule, num(sums[4]))
      over = over_share(held, need_f.b, rule.mine, weight, rule.total, rule.pool)
      if over then floor = need_f.b + headroom * eng.min_capacity(g) end
    end

    -- Whether an engine of the order (not an exception) with these figures passes; nil when
    -- none further down can (within its share the rule does not depend on the engine).
    local function passes(free, running, kind)
      local k = eng.kind_info(g, kind)
      local slots = k.seqs + (staged and k.staged or 0)
      if need_f.b > free or need_f.s > slots - running then return false end
      if rule and not allows(rule, need_f.b, k.cap, free) then
        if over then return false end
        return nil
      end
      return true
    end

    local lo, hi = '[' .. g .. '\0', '(' .. g .. '\1'
    local first, offset, walking, batch = nil, 0, true, nil
    while walking do
      batch = redis.call('ZRANGEBYLEX', K_GORD, lo, hi, 'LIMIT', offset, 32)
      for at, m in ipairs(batch) do
        local free, running, kind, name = eng.parse_member(g, m)
        if free < floor then
          walking = false
          break
        end
        if not special[name] then
          local verdict = passes(free, running, kind)
          if verdict == nil then
            walking = false
            break
          end
          if verdict then
            first = {name = name, free = free, running = running, kind = kind, at = at}
            walking = false
            break
          end
        end
      end
      if walking then
        if #batch < 32 then walking = false end
        offset = offset + 32
      end
    end

    -- The engines ranked as the first: parts of one (running, kind), each in name order
    -- (`names`: those not exceptions, when the walk's read holds the whole rank).
    local parts, ntied, ranked = {}, 0, nil
    local function add_part(part, n, names, skip)
      local free, running, kind = eng.parse_member(g, part .. '\0')
      if n > #skip and passes(free, running, kind) then
        table.sort(skip)
        parts[#parts + 1] = {prefix = part, n = n, names = names, skip = skip}
        ntied = ntied + n - #skip
      end
    end
    if first then
      local rank = eng.rank_of(first.free, first.running, first.kind)
      local top = g .. '\0' .. string.sub(rank, 1, by_running == 'running' and 19 or 12)
      local from, to = first.at, first.at
      while from > 1 and string.sub(batch[from - 1], 1, #top) == top do from = from - 1 end
      while to < #batch and string.sub(batch[to + 1], 1, #top) == top do to = to + 1 end
      if (from > 1 or offset == 0) and (to < #batch or #batch < 32) then
        local part, names = nil, nil
        for i = from, to do
          local m = batch[i]
          local p = string.sub(m, 1, #g + 1 + eng.RANK_LEN)
          if p ~= part then
            if part then add_part(part, #names, names, {}) end
            part, names = p, {}
          end
          local name = string.sub(m, #p + 2)
          if not special[name] then names[#names + 1] = name end
        end
        add_part(part, #names, names, {})
      else
        local cursor = '[' .. top
        while true do
          local m = redis.call('ZRANGEBYLEX', K_GORD, cursor, '(' .. top .. '\255',
            'LIMIT', 0, 1)[1]
          if not m then break end
          local part = string.sub(m, 1, #g + 1 + eng.RANK_LEN)
          local n = redis.call('ZLEXCOUNT', K_GORD, '[' .. part .. '\0', '(' .. part .. '\1')
          local skip = {} -- the exceptions' places in this part (scored as exceptions)
          for name in pairs(special) do
            local at_ = redis.call('HGET', K_GRP, g .. '\0' .. name)
            local mm = at_ and string.match(at_, '^[^|]*|[^|]*|[^|]*|(.*)$')
            if mm and string.sub(mm, 1, #part + 1) == part .. '\0' then
              skip[#skip + 1] = redis.call('ZLEXCOUNT', K_GORD, '[' .. part .. '\0', '(' .. mm)
            end
          end
          add_part(part, n, nil, skip)
          cursor = '[' .. part .. '\1'
        end
      end
      local k = eng.kind_info(g, first.kind)
      ranked = score_of({b = need_f.b, cached = need_f.cached, cap = k.cap}, first.free,
        first.running)
    end

    -- The exceptions, scored as every engine is.
    local best = ranked
    for _, c in ipairs(ex) do
      local got = redis.call('HMGET', K_LOAD, 'b:' .. c.name, 's:' .. c.name)
      local free = c.cap - num(got[1]) - c.for_b
      local running = num(got[2]) + c.for_s
      local ok = c.healthy and c.b <= free and c.s <= c.max_seqs - running
      if ok and rule then ok = allows(rule, c.b, c.cap, free) end
      if ok then
        c.score = score_of(c, free, running)
        if best == nil or compare(c.score, best) > 0 then best = c.score end
      end
    end
    if best == nil then return {'refused', 'no_capacity', ''} end
    local tied_ex = {}
    for _, c in ipairs(ex) do
      if c.score and compare(c.score, best) == 0 then tied_ex[#tied_ex + 1] = c end
    end
    table.sort(tied_ex, function(a, b) return a.name < b.name end)
    local function common(name)
      return {name = name, b = need_f.b, s = need_f.s, pb = need_f.pb, h = need_f.h, cr = 0}
    end
    -- The i-th (from 0) engine of a part, less its exceptions, read alone; and all of them.
    local function nth(part, i)
      if part.names then return part.names[i + 1] end
      for _, r in ipairs(part.skip) do
        if r <= i then i = i + 1 end
      end
      local m = redis.call('ZRANGEBYLEX', K_GORD, '[' .. part.prefix .. '\0',
        '(' .. part.prefix .. '\1', 'LIMIT', i, 1)[1]
      return string.sub(m, #part.prefix + 2)
    end
    local function names_of(part)
      if part.names then return part.names end
      local names = {}
      for _, m in ipairs(redis.call('ZRANGEBYLEX', K_GORD, '[' .. part.prefix .. '\0',
          '(' .. part.prefix .. '\1')) do
        local name = string.sub(m, #part.prefix + 2)
        if not special[name] then names[#names + 1] = name end
      end
      return names
    end
    -- As `Router.pick` over every engine: the best score, its ties in name order.
    if ranked ~= nil and compare(ranked, best) == 0 and ntied > 0 then
      if #tied_ex == 0 and #parts == 1 then return common(nth(parts[1], seed % ntied)) end
      local ties = {}
      for _, part in ipairs(parts) do
        for _, name in ipairs(names_of(part)) do ties[#ties + 1] = {name = name} end
      end
      for _, c in ipairs(tied_ex) do ties[#ties + 1] = {name = c.name, c = c} end
      table.sort(ties, function(a, b) return a.name < b.name end)
      local t = ties[(seed % #ties) + 1]
      return t.c or common(t.name)
    end
    return tied_ex[(seed % #tied_ex) + 1]
  end

  if grouped then
    local got = ordered()
    if got and got[1] == 'refused' then return finish(got) end
    chosen = got
    if not chosen then
      -- Every engine of the group with a view, in name order, as a candidate.
      local special = {}
      for _, x in ipairs(exc) do special[x.name] = x.f end
      local names = redis.call('HGET', K_GRP, g .. ':m') or ''
      for name in string.gmatch(names, '[^\n]+') do
        local v = eng.view_of(name)
        if v then cands[#cands + 1] = candidate(name, v, special[name] or need_f) end
      end
    end
  end

  if not chosen then
    -- Candidates within the tenant's KV share.
    local engines, within, pool, need = {}, {}, 0, 0
    local fields = {} -- the loads of the candidates within the share: 'b:<name>', 's:<name>'
    for _, c in ipairs(cands) do
      if c.b > need then need = c.b end -- the headroom rule's, before credit
      credit(c)
      engines[c.name] = true
      pool = pool + c.cap
      if within_share(c.b) then
        within[#within + 1] = c
        fields[#fields + 1] = 'b:' .. c.name
        fields[#fields + 1] = 's:' .. c.name
      end
    end
    if #cands > 0 and #within == 0 then return refuse('tenant_kv_share') end
    local rule_of = headroom_rule(pool, need)
    do -- (its local ends here: at most 200 at once)
      local reply = line_reply(engines, rule_of)
      if reply then return finish(reply) end
    end
    local rule = rule_of()

    -- Routing (gateway/core/routing.py): filter, score, then a seeded choice among ties.
    local pool_free = 0
    for first = 1, #within, 500 do -- one HMGET per 500 engines (unpack's limit is far above)
      local last = math.min(#within, first + 499)
      local loads = redis.call('HMGET', K_LOAD, unpack(fields, 2 * first - 1, 2 * last))
      for i = first, last do
        local c, at_ = within[i], 2 * (i - first)
        local res_b = tonumber(loads[at_ + 1]) or 0
        c.res_b, c.res_s = res_b, tonumber(loads[at_ + 2]) or 0
        local free = c.cap - res_b - c.for_b
        if free > 0 then pool_free = pool_free + free end
      end
    end
    local best, ties = nil, {}
    for _, c in ipairs(within) do
      local free = c.cap - c.res_b - c.for_b
      local running = c.res_s + c.for_s
      local room = c.healthy and c.b <= free and c.s <= c.max_seqs - running
      if room and rule then
        if rule.excess == nil then with_claims(rule, pool_free) end
        room = allows(rule, c.b, c.cap, free)
      end
      if room then
        local score = score_of(c, free, running)
        if score == nil then return redis.error_reply('unknown scorer in ' .. ARGV[17]) end
        local cmp = best and compare(score, best) or 1
        if cmp > 0 then
          best, ties = score, {c}
        elseif cmp == 0 then
          ties[#ties + 1] = c
        end
      end
    end
    if best == nil then return refuse('no_capacity') end
    chosen = ties[(seed % #ties) + 1]
  end
end

-- The lease, the counters, the charges.
local l = {
  e = chosen.name, b = chosen.b, s = chosen.s, pb = chosen.pb, t = tenant, k = tokens, r = replica,
  rpm = rpm, tpm = tpm, p = prio, w = weight,
}
if chosen.h and #chosen.h > 0 then l.h, l.c = chosen.h, chosen.cr end
hset(K_LEASES, id, cjson.encode(l))
zadd(K_LEXP, NOW + lease_ttl, id)
local shared = l.h and hold_prefix(l.e, l.h) or 0
load_add(chosen.name, private(l, l.b) + shared, chosen.s, private(l, l.pb) + shared)
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
