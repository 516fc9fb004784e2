-- engines: what grouped asks are decided on (issue 14, docs/engine-index.md).
-- ARGV 4 'views', then per engine 7 values: name, usable blocks, max_num_seqs, staged seqs,
--   foreign blocks, foreign seqs, healthy '1'/'0'. Each engine is moved in its groups.
--   Reply: the number of views.
-- ARGV 4 'group', 5 its name, 6 its KV ceiling, then its engines (sorted): the group is
--   made afresh from the views and loads held (unless it is already so), and stamped as
--   used (common.lua `eng.stamp`). Reply 1 if made, 0 if it was already so.
local what = ARGV[4]
if what == 'views' then
  local n = 0
  for i = 5, #ARGV, 7 do
    local name = ARGV[i]
    hset(K_VIEWS, name, table.concat({ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
      ARGV[i + 5], ARGV[i + 6]}, ','))
    reorder(name)
    n = n + 1
  end
  return finish(n)
elseif what == 'group' then
  local g, ceiling = ARGV[5], ARGV[6]
  local names = {}
  for i = 7, #ARGV do names[#names + 1] = ARGV[i] end
  local members = table.concat(names, '\n')
  local was = redis.call('HMGET', K_GRP, g, g .. ':m')
  if was[1] == ceiling and was[2] == members then
    eng.stamp(g)
    return finish(0)
  end
  eng.drop(g) -- whatever the group held before goes
  eng.stamp(g)
  hset(K_GRP, g, ceiling, g .. ':m', members)
  ceilings[g] = tonumber(ceiling) -- (eng.drop emptied `kinds`)
  for _, name in ipairs(names) do
    local groups = redis.call('HGET', K_EG, name)
    hset(K_EG, name, groups and (groups .. '\n' .. g) or g)
    reorder(name)
  end
  return finish(1)
end
return redis.error_reply('engines: unknown ' .. tostring(what))
