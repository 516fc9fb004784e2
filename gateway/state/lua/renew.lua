-- renew: ARGV 3 lease ttl s, then lease ids. Reply: the ids that no longer exist (expired).
reap_leases()
local ttl, lost = tonumber(ARGV[3]), {}
for i = 4, #ARGV do
  if redis.call('ZADD', K_LEXP, 'XX', 'CH', NOW + ttl, ARGV[i]) == 0
      and not redis.call('ZSCORE', K_LEXP, ARGV[i]) then
    lost[#lost + 1] = ARGV[i]
  end
end
return finish(lost)
