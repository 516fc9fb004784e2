-- extend: ARGV 3 lease id, 4 blocks to add. A running request outgrew its (predicted)
-- reservation: its engine holds the blocks already, so nothing is checked. A lease that is
-- gone is not revived. The tenant's fair-queuing finish tag is charged the new blocks. Reply: the lease's blocks now, or 0 when it is gone.
reap_leases()
local raw = redis.call('HGET', K_LEASES, ARGV[3])
if not raw then return finish(0) end
local l, more = cjson.decode(raw), tonumber(ARGV[4])
l.b = l.b + more
redis.call('HSET', K_LEASES, ARGV[3], cjson.encode(l))
add(K_LOAD, 'b:' .. l.e, more)
add(K_TEN, 'k:' .. l.t, more)
-- The fair line: the tenant's finish tag moves on, as for a job of `more` blocks started
-- now (no burst credit).
if l.p and l.w then charge(l.t, l.p, l.w, more, 0) end
return finish(l.b)
