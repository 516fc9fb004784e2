-- extend: ARGV 4 lease id, 5 the lease's blocks as the caller knows them, 6 the blocks it
-- should hold now, 7 the line's burst credit (for when the tag stops mattering; '' or
-- absent from an older replica: unknown). A running request outgrew its (predicted)
-- reservation: its engine holds the blocks already, so nothing is checked. Safe to run
-- twice (a retried call): only what the lease lacks of ARGV 6 is added. A lease that is
-- gone is not revived. The tenant's fair-queuing served finish tag moves on by the added
-- blocks / weight, from max(V, F) (no burst credit; V does not move).
-- Reply: the lease's blocks now, or 0 when it is gone.
reap_leases()
local raw = redis.call('HGET', K_LEASES, ARGV[4])
if not raw then return finish(0) end
local l, target = cjson.decode(raw), tonumber(ARGV[6])
local more = target - l.b
if more <= 0 then return finish(l.b) end
local held = num(redis.call('HGET', K_TEN, 'k:' .. l.t))
local rec = observe(l.t, nil, held, nil) -- before
l.b = target
hset(K_LEASES, ARGV[4], cjson.encode(l))
load_add(l.e, more, 0, 0)
add(K_TEN, 'k:' .. l.t, more)
settle(l.t, rec, held + more)
if present(l.p) and present(l.w) then
  local f = 'f:' .. l.p .. ':' .. l.t
  local start = math.max(virtual_now(l.p), fair_num(f))
  set_served(l.t, l.p, start + more / l.w, l.w, opt(ARGV[7]))
end
return finish(l.b)
