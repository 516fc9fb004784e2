-- release: ARGV 3 lease id, 4 used tokens ('' = unknown), 5 '1' when a renewal round of
-- its replica is on its way (it may have read the lease as held). Reply 1 the first time,
-- 0 after. In that case the id is remembered as released for 60 s (`gone`): the round's
-- script must not write it again (renew.lua), or its blocks would count twice once they
-- are admitted to someone else.
reap_leases()
local l = drop_lease(ARGV[3], opt(ARGV[4]))
if ARGV[5] == '1' then
  redis.call('ZREMRANGEBYSCORE', K_GONE, '-inf', NOW - 60)
  zadd(K_GONE, NOW, ARGV[3])
end
return finish(l and 1 or 0)
