-- renew: ARGV 4 lease ttl s, 5 the number N of queue entries, then N entry ids (this
-- replica's waiters: each stays `lease ttl` more, never past its deadline), then pairs
-- (lease id, lease json as admit.lua wrote it).
-- A lease that Redis no longer has (lost in a restart, or expired while its renewals failed)
-- belongs to a request that is still running: it is written again, with its counters, so
-- the blocks it holds on its engine are counted, unless its replica released it since this
-- round read it (release.lua `gone`). Then one group unused for a key TTL, if any, is
-- dropped (common.lua `eng.sweep`). Reply: the ids written again.
reap_leases()
expire_queue()
local ttl, restored = tonumber(ARGV[4]), {}
local entries = tonumber(ARGV[5])
for i = 6, 5 + entries do renew_entry(ARGV[i], ttl) end
for i = 6 + entries, #ARGV - 1, 2 do
  local id = ARGV[i]
  if redis.call('ZADD', K_LEXP, 'XX', 'CH', NOW + ttl, id) == 0 -- XX: never creates
      and not redis.call('ZSCORE', K_LEXP, id)
      and not redis.call('ZSCORE', K_GONE, id) then -- released meanwhile: not revived
    local raw = ARGV[i + 1]
    local l = cjson.decode(raw)
    local held = num(redis.call('HGET', K_TEN, 'k:' .. l.t))
    local rec = observe(l.t, nil, held, nil)
    hset(K_LEASES, id, raw)
    zadd(K_LEXP, NOW + ttl, id)
    local new = l.h and hold_prefix(l.e, l.h) or 0
    load_add(l.e, private(l, l.b) + new, l.s, private(l, l.pb or 0) + new)
    add(K_TEN, 'n:' .. l.t, 1)
    add(K_TEN, 'k:' .. l.t, l.b)
    settle(l.t, rec, held + l.b)
    restored[#restored + 1] = id
  end
end
eng.sweep(KEY_TTL_MS / 1000, 1) -- a group no replica asked on for a key TTL
return finish(restored)
