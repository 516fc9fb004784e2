-- release: ARGV 4 lease id, 5 used tokens ('' = unknown), 6 '1' when a renewal round of
-- its replica is on its way (it may have read the lease as held). Reply 1 the first time,
-- 0 after. In that case the id is remembered as released for 60 s (`gone`): the round's
-- script must not write it again (renew.lua), or its blocks would count twice once they
-- are admitted to someone else.
reap_leases()
local l = drop_lease(ARGV[4], opt(ARGV[5]))
if ARGV[6] == '1' then
  redis.call('ZREMRANGEBYSCORE', K_GONE, '-inf', NOW - 60)
  zadd(K_GONE, NOW, ARGV[4])
end
return finish(l and 1 or 0)
