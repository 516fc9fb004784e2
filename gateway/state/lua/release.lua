-- release: ARGV 3 lease id, 4 used tokens ('' = unknown). Reply 1 the first time, 0 after.
-- The id is remembered as released for 60 s (`gone`): a renewal round of its replica that
-- read it as held before this release must not write it again (renew.lua), or its blocks
-- would count twice once they are admitted to someone else.
reap_leases()
local l = drop_lease(ARGV[3], opt(ARGV[4]))
redis.call('ZREMRANGEBYSCORE', K_GONE, '-inf', NOW - 60)
zadd(K_GONE, NOW, ARGV[3])
return finish(l and 1 or 0)
