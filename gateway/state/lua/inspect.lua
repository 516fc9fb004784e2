-- Read what the store holds (after reaping). ARGV 4 what:
--   'length'          -> queued entries
--   'ahead', engines  -> blocks wanted by queued entries competing for any of them
--   'loads'           -> flat HGETALL of the load hash
--   'rates', tenant   -> {requests level, stamp, tokens level, stamp, now} ('' when full)
--   'totals'          -> {leases, queued, flat load hash, flat tenant hash}
reap_leases()
expire_queue()
local what = ARGV[4]
if what == 'length' then
  return finish(redis.call('ZCARD', K_QEXP))
elseif what == 'ahead' then
  local wanted, total = {}, 0
  for i = 5, #ARGV do wanted[ARGV[i]] = true end
  for _, raw in ipairs(redis.call('HVALS', K_QENT)) do
    local e = cjson.decode(raw)
    if eng.wanted(e, wanted) then total = total + e.b end
  end
  return finish(total)
elseif what == 'loads' then
  return finish(redis.call('HGETALL', K_LOAD))
elseif what == 'rates' then
  local t = ARGV[5]
  local got = redis.call('HMGET', K_RATE, t .. ':rl', t .. ':rs', t .. ':tl', t .. ':ts')
  return finish({got[1] or '', got[2] or '', got[3] or '', got[4] or '', fmt(NOW)})
elseif what == 'totals' then
  return finish({
    redis.call('HLEN', K_LEASES), redis.call('ZCARD', K_QEXP),
    redis.call('HGETALL', K_LOAD), redis.call('HGETALL', K_TEN),
  })
end
return redis.error_reply('inspect: unknown ' .. tostring(what))
