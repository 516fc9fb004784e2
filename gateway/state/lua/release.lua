-- release: ARGV 3 lease id, 4 used tokens ('' = unknown). Reply 1 the first time, 0 after.
reap_leases()
local l = drop_lease(ARGV[3], opt(ARGV[4]))
return finish(l and 1 or 0)
