"""Where the Redis scripts' time goes, measured inside redis-server under the running gateway.

    .venv/bin/python benchmarks/profile_lua.py [--seconds 10] [--concurrency 32] [--plain]

One run starts a zero-cost simulated engine, a private `redis-server` on a free port and
`kv-gateway serve` with its state in that Redis, as `bench_state_cost.py` does. Before the
gateway starts, the profiler loads into Redis the gateway's own function library, under the
gateway's own library name (a digest of its text, `gateway.state.redis._library`) but
instrumented: every top-level function of common.lua timed (inclusive: a Redis `TIME` before
and after), each script's body timed whole and by its sections (the comment blocks at column
0 of the script's file start a section), and one function more that hands the figures out.
The gateway finds its library loaded and calls it. A closed-loop window of small completions
follows; the figures are printed per request (per admission):

* each script's whole time as redis-server counts it (`INFO commandstats`, FCALL's µs: the
  arguments' decoding, the call, the reply, Redis's garbage-collection steps) against the
  body's time as its timers saw it;
* per function and per section: calls and inclusive µs, the timers' own cost included.

The timers cost something: one `TIME` command and a little Lua per timed call (measured and
printed, `timer pair`): a function called often shows that cost many times over, so read
the figures as where the time goes, not as what a rewrite would save; `--plain` runs the
same window on the library as the gateway ships it (commandstats only), to set the
instrumented totals against. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_overhead import Load, gateway_config, rate_window, request_body, start_engine
from bench_state_cost import commandstats

from gateway.harness import GatewayProcess, RedisServer
from gateway.loadtest.cpu import loadavg, machine
from gateway.state import redis as redis_store
from gateway.state.scripts import Library

# Too small to time (a timer pair costs more than they do); they stay as they are.
UNTIMED = {"standard", "opt", "fmt", "num", "present"}
FUNCTION = re.compile(r"^local function (\w+)\(")

PROLOGUE = """
local __prof = {} -- label -> {calls, inclusive µs, self µs, timed calls made from it}
local function __clock()
  local t = redis.call('TIME')
  return t[1] * 1000000 + t[2]
end
local function __add(label, dt, own, inner)
  local p = __prof[label]
  if p == nil then
    p = {0, 0, 0, 0}
    __prof[label] = p
  end
  p[1], p[2], p[3], p[4] = p[1] + 1, p[2] + dt, p[3] + own, p[4] + inner
end
-- The frames of the timed calls in progress: the time and the count of their timed callees.
local __child, __inner, __depth = {}, {}, 0
local function __enter()
  __depth = __depth + 1
  __child[__depth], __inner[__depth] = 0, 0
end
local function __leave(label, dt)
  local own, inner = dt - __child[__depth], __inner[__depth]
  __depth = __depth - 1
  if __depth > 0 then
    __child[__depth] = __child[__depth] + dt
    __inner[__depth] = __inner[__depth] + 1
  end
  __add(label, dt, own, inner)
end
local __open, __open_t
local function __section(label)
  local now = __clock()
  if __open then __add(__open, now - __open_t, 0, 0) end
  __open, __open_t = label, now
end
local function __wrap(label, f)
  return function(...)
    if label == 'finish' then __section(nil) end
    __enter()
    local t0 = __clock()
    local r = {f(...)}
    __leave(label, __clock() - t0)
    return unpack(r, 1, table.maxn(r))
  end
end
local function __body(label, f, keys, argv)
  __depth = 0
  __enter()
  local t0 = __clock()
  local r = f(keys, argv)
  __leave(label, __clock() - t0)
  return r
end
-- Defined before common.lua's locals shadow the standard functions.
local function __dump(reset)
  local out = {}
  for label, p in pairs(__prof) do
    out[#out + 1] = {label, tostring(p[1]), tostring(p[2]), tostring(p[3]), tostring(p[4])}
  end
  if reset then __prof = {} end
  return out
end
local function __timer()
  local t0 = __clock()
  for _ = 1, 1000 do
    __enter()
    local t1 = __clock()
    __leave('(timer test)', __clock() - t1)
  end
  __prof['(timer test)'] = nil
  return tostring((__clock() - t0) / 1000)
end
"""


def instrument_common(source: str) -> str:
    """common.lua with each top-level function (but the tiny ones) timed once defined."""
    out = [PROLOGUE]
    current: str | None = None
    for line in source.splitlines():
        out.append(line)
        m = FUNCTION.match(line)
        if m and current is None:
            current = m.group(1)
        elif line == "end" and current is not None:
            if current not in UNTIMED:
                out.append(f"{current} = __wrap('{current}', {current})")
            current = None
    return "\n".join(out)


def instrument_body(script: str, body: str) -> str:
    """A script's body with a section mark at the first line of each column-0 comment block."""
    out = [f"__section('{script}: (start)')"]
    previous_comment = False
    for line in body.splitlines():
        comment = line.startswith("-- ")
        if comment and not previous_comment:
            label = line[3:].split(":")[0].split("(")[0].strip()[:48].replace("'", "")
            out.append(f"__section('{script}: {label}')")
        out.append(line)
        previous_comment = comment
    return "\n".join(out)


def instrumented_library() -> tuple[str, str]:
    """(the gateway's library name, the instrumented library's text under that name)."""
    name = redis_store._library().name
    lua = redis_store._lua
    parts = [f"#!lua name={name}", instrument_common(lua("common"))]
    for script in redis_store.SCRIPTS:
        fn = Library.function_name(name, script)
        parts.append(
            f"local function __body_{script}(KEYS, ARGV)\nbegin(KEYS, ARGV)\n"
            f"{instrument_body(script, lua(script))}\nend\n"
            f"redis.register_function('{fn}', function(KEYS, ARGV)\n"
            f"  return __body('{script} (body)', __body_{script}, KEYS, ARGV)\nend)"
        )
    parts.append(
        f"redis.register_function('{name}_profile', function(KEYS, ARGV)\n"
        "  return __dump(ARGV[1] == 'reset')\nend)\n"
        f"redis.register_function('{name}_timer', function(KEYS, ARGV)\n"
        "  return __timer()\nend)"
    )
    return name, "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="profile_lua.py", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokenizer", default="hf:@tiny")
    p.add_argument("--plain", action="store_true", help="the library as shipped (no timers)")
    args = p.parse_args(argv)
    import redis as redis_py

    print(f"machine: {machine()}; load average {loadavg()}")
    redis = RedisServer().start()
    children = []
    pair = 0.0
    try:
        name, text = instrumented_library()
        client = redis_py.Redis.from_url(redis.url)
        if not args.plain:
            client.execute_command("FUNCTION", "LOAD", "REPLACE", text)
            pair = float(client.execute_command("FCALL", f"{name}_timer", 0))
            print(f"timer pair (two TIME calls and the bookkeeping): {pair:.2f} µs")
        with tempfile.TemporaryDirectory(prefix="bench-lua-") as tmp:
            workdir = Path(tmp)
            engine, engine_url = start_engine(workdir)
            children.append(engine)
            gw = GatewayProcess(
                gateway_config(engine_url, args.tokenizer, redis.url), workdir, own_group=True
            )
            children.append(gw.start())
            path, body = request_body("completion", stream=False, max_tokens=8)
            load = Load("raw", gw.url, path, body, args.seconds)
            servers = {"gateway": gw.pid or 0, "engine": engine.pid or 0}
            if redis.proc is not None:
                servers["redis-server"] = redis.proc.pid
            # A short window first: the tokenizer, the connections, the library all warm.
            rate_window(
                gw.url,
                Load("raw", gw.url, path, body, 2.0),
                concurrency=args.concurrency,
                procs=1,
                servers=servers,
            )
            if not args.plain:
                client.execute_command("FCALL", f"{name}_profile", 0, "reset")
            before = commandstats(redis.url)
            res = rate_window(gw.url, load, concurrency=args.concurrency, procs=1, servers=servers)
            after = commandstats(redis.url)
            rows = [] if args.plain else client.execute_command("FCALL", f"{name}_profile", 0)
            client.close()
    finally:
        for child in reversed(children):
            child.stop()
        redis.stop()
    figures = {r[0].decode(): tuple(int(x) for x in r[1:]) for r in rows}
    admits = after.get("fcall", (0, 0))[0] - before.get("fcall", (0, 0))[0]
    print(
        f"{res.rps:.0f} req/s, errors {res.errors}; CPU per request: redis-server "
        f"{res.cpu_ms_per_request.get('redis-server', 0) * 1000:.0f} µs, gateway "
        f"{res.cpu_ms_per_request.get('gateway', 0) * 1000:.0f} µs"
    )
    n = figures.get("admit (body)", (0,))[0] or max(1, admits // 2)
    print(f"per admission ({n} admissions, {admits} FCALLs), from INFO commandstats:")
    for cmd in ("fcall", "time"):
        (c1, u1), (c0, u0) = after.get(cmd, (0, 0)), before.get(cmd, (0, 0))
        print(f"  {cmd:6} {(c1 - c0) / n:7.2f} calls  {(u1 - u0) / n:8.1f} µs")
    others = [
        (a[0] - before.get(k, (0, 0))[0], a[1] - before.get(k, (0, 0))[1])
        for k, a in after.items()
        if k not in ("fcall", "time", "evalsha", "info", "function|load")
    ]
    print(
        f"  the other commands the scripts ran: {sum(c for c, _ in others) / n:7.2f} calls  "
        f"{sum(u for _, u in others) / n:8.1f} µs (their execution only)"
    )
    if not figures:
        return 0
    half = pair / 2
    print(
        "per admission, from the timers (inclusive; self = without the timed calls it made; "
        f"self less timers = self less {half:.2f} µs per timed call in and from it):"
    )
    print(f"  {'':44} {'calls':>7} {'incl µs':>9} {'self µs':>9} {'less timers':>11}")
    for label, (calls, incl, own, inner) in sorted(figures.items(), key=lambda kv: -kv[1][2]):
        net = own - half * (calls + inner)
        print(f"  {label:44} {calls / n:7.2f} {incl / n:9.1f} {own / n:9.1f} {net / n:11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
