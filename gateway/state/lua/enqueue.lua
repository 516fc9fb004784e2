-- enqueue: ARGV 3 id, 4 tenant, 5 priority, 6 weight, 7 blocks, 8 max wait s,
--   9 max length, 10 tenant cap ('' = none), 11 TTL for the keys (covers the wait),
--   12 the line's burst credit in blocks, 13 headroom (0 = off), 14 the active window s,
--   then the engine names. Reply: 'queued' | 'queue_full' | 'tenant_queue_full'.
local id, tenant, prio, weight = ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local blocks, max_wait, max_length = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local cap, ttl, burst = opt(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local headroom, window = tonumber(ARGV[13]), tonumber(ARGV[14])
expire_queue()
touch(math.floor(ttl * 1000))
if redis.call('HEXISTS', K_QENT, id) == 1 then return finish('queued') end
if redis.call('ZCARD', K_QEXP) >= max_length then return finish('queue_full') end
if cap and tenant_queued(tenant) >= cap then return finish('tenant_queue_full') end
local engines = {}
for i = 15, #ARGV do engines[#engines + 1] = ARGV[i] end
push(id, tenant, prio, weight, engines, blocks, NOW + max_wait, burst)
if headroom > 0 then
  observe(tenant, weight, num(redis.call('HGET', K_TEN, 'k:' .. tenant)), window)
end
return finish('queued')
