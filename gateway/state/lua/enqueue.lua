-- enqueue: ARGV 4 id, 5 tenant, 6 priority, 7 weight, 8 blocks, 9 max wait s,
--   10 max length, 11 tenant cap ('' = none), 12 TTL for the keys (covers the wait),
--   13 the line's burst credit in blocks, 14 headroom (0 = off), 15 the active window s,
--   16 the owner replica, 17 its lease ttl s (the entry lives that long unless renewed),
--   then the engine names. Reply: 'queued' | 'queue_full' | 'tenant_queue_full'.
local id, tenant, prio, weight = ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local blocks, max_wait, max_length = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local cap, ttl, burst = opt(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local headroom, window = tonumber(ARGV[14]), tonumber(ARGV[15])
local owner, lease_ttl = ARGV[16], tonumber(ARGV[17])
expire_queue()
touch(math.floor(ttl * 1000))
if redis.call('HEXISTS', K_QENT, id) == 1 then return finish('queued') end
if redis.call('ZCARD', K_QEXP) >= max_length then return finish('queue_full') end
local queued = tenant_queued(tenant)
if cap and queued >= cap then return finish('tenant_queue_full') end
-- Headroom for the line (gateway/core/headroom.py line_allows): a tenant above its
-- weighted share of max_length leaves the last places to the others while they are active.
if headroom > 0 then
  local others = others_weight(active_now(window), activity(tenant))
  local length = redis.call('ZCARD', K_QEXP)
  if others > 0 and (queued + 1) * (weight + others) > weight * max_length
      and length + 1 > (1 - headroom) * max_length then
    return finish('queue_full')
  end
end
local engines = {}
for i = 18, #ARGV do engines[#engines + 1] = ARGV[i] end
push(id, tenant, prio, weight, engines, blocks, NOW + max_wait, owner, lease_ttl, burst)
if headroom > 0 then
  local held = num(redis.call('HGET', K_TEN, 'k:' .. tenant))
  settle(tenant, observe(tenant, weight, held, window, blocks), held)
else
  settle(tenant, nil)
end
return finish('queued')
