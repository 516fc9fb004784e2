"""Each admission rule changed once in the Lua: the differential test must fail (issue 39).

    .venv/bin/python tests/state/mutate_lua.py [--only 9,16a] [--seed N] [-k EXPR] [--list]

For each mutation below — a rule of `tests/state/test_lua_differential.py`'s docstring (its
number), and one small change of the Lua (a comparison flipped, a term dropped) — the
scripts are copied into a temporary directory with that one change, and `pytest
tests/state/test_lua_differential.py` runs in a child process whose Redis store reads its
scripts from there: this module, loaded by the child as a pytest plugin (`-p`), points
`gateway.state.redis.LUA_DIR` at the directory `KVGW_MUTANT_LUA` names, and turns
Hypothesis's example database (a mutant's failures are not kept to be replayed later) and
its shrinking off. The real files are never touched. First a control run on an unchanged
copy, which must pass; then one line per mutation: killed (the test that failed, its
error) or SURVIVED, and how long it took. Exits 1 if any survived. Each mutation's text
must occur exactly once in its file (checked before anything runs).

`-k TestLuaAndPython` runs the state machine alone (its random walks; `-k "not
TestLuaAndPython"` the pinned walks alone): which mutations a random run finds, and which
need a pinned walk to be found every time. Not collected by pytest (no `test_` prefix).
Rule 31 (an engine that stops caching makes its credited leases whole) is decided in Python
on both stores (`_make_whole`); its Lua part is `extend`, mutated under rule 32.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ENV = "KVGW_MUTANT_LUA"
ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "gateway" / "state" / "lua"
TEST = "tests/state/test_lua_differential.py"


class Mutation(NamedTuple):
    rule: str
    what: str
    file: str
    old: str
    new: str


MUTATIONS = (
    Mutation(
        "1",
        "concurrency: one more request in flight allowed",
        "admit.lua",
        "'n:' .. tenant)) + 1 > max_conc then",
        "'n:' .. tenant)) > max_conc then",
    ),
    Mutation(
        "2",
        "requests bucket: refused only when empty, not below 1",
        "admit.lua",
        "  if rpm_level < 1 then",
        "  if rpm_level < 0 then",
    ),
    Mutation(
        "3",
        "tokens refund: half of what was not used",
        "common.lua",
        "bucket_level(l.t, 't', l.tpm) + (l.k - used)",
        "bucket_level(l.t, 't', l.tpm) + (l.k - used) / 2",
    ),
    Mutation(
        "4a",
        "a refusal by tokens charges the requests bucket",
        "admit.lua",
        "    return refuse('tenant_tpm', ok and",
        "    if rpm then bucket_set(tenant, 'r', rpm, rpm_level - 1) end\n"
        "    return refuse('tenant_tpm', ok and",
    ),
    Mutation(
        "4b",
        "order: requests per minute checked before concurrency",
        "admit.lua",
        "if max_conc and num(redis.call('HGET', K_TEN, 'n:' .. tenant)) + 1 > max_conc then",
        "if rpm and bucket_level(tenant, 'r', rpm) < 1 then\n"
        "  return refuse('tenant_rpm', seconds_until(1, bucket_level(tenant, 'r', rpm), rpm))\n"
        "end\n"
        "if max_conc and num(redis.call('HGET', K_TEN, 'n:' .. tenant)) + 1 > max_conc then",
    ),
    Mutation(
        "5",
        "KV share: what the tenant holds not counted",
        "admit.lua",
        "return max_blocks == nil or held + b <= max_blocks",
        "return max_blocks == nil or b <= max_blocks",
    ),
    Mutation(
        "6",
        "a grant's requests figure: the level before its charge",
        "admit.lua",
        "rpm and fmt(rpm_level - 1) or ''",
        "rpm and fmt(rpm_level) or ''",
    ),
    Mutation(
        "7a",
        "active tenants: kept for twice the window",
        "common.lua",
        "if not (NOW - tonumber(got[i + 1]) > window) then",
        "if not (NOW - tonumber(got[i + 1]) > 2 * window) then",
    ),
    Mutation(
        "7b",
        "the others' weights: the asking tenant's own counted",
        "common.lua",
        "return weight_sum(t.w, own and limbs(own.w) or nil)",
        "return weight_sum(t.w, nil)",
    ),
    Mutation(
        "8",
        "recent usage: decays over twice the window",
        "common.lua",
        "math.exp(-math.max(0, NOW - a.us) / window)",
        "math.exp(-math.max(0, NOW - a.us) / (2 * window))",
    ),
    Mutation(
        "9",
        "over its share: recent usage not tested",
        "common.lua",
        "(held + need) * total > share and (average + need) * total > share",
        "(held + need) * total > share",
    ),
    Mutation(
        "10",
        "above its share: the engine's headroom not kept",
        "admit.lua",
        "return free - b >= headroom * cap",
        "return free - b >= 0",
    ),
    Mutation(
        "11a",
        "above its share: the others' unused shares not kept",
        "admit.lua",
        "        and after - rule.excess >= unused_against(rule.unused(), after - rule.excess)",
        "        and true",
    ),
    Mutation(
        "11b",
        "unused shares: never summed term by term near a whole number",
        "common.lua",
        "if math.abs(free - u.approx) > u.slack then return u.approx end",
        "if true then return u.approx end",
    ),
    Mutation(
        "12a",
        "within its share: the others' burst claims not kept",
        "admit.lua",
        "return after >= rule.claims",
        "return after >= 0",
    ),
    Mutation(
        "12b",
        "burst claims: the excess over unused shares not kept above the share",
        "admit.lua",
        "after - rule.excess >= unused_against(rule.unused(), after - rule.excess)",
        "after >= unused_against(rule.unused(), after)",
    ),
    Mutation(
        "13",
        "passing: an ask above its share passes entries too",
        "admit.lua",
        "if not over_share(held, need, mine, weight, total, pool) then",
        "if true then",
    ),
    Mutation(
        "14",
        "the line's headroom: no places kept",
        "enqueue.lua",
        "length + 1 > (1 - headroom) * max_length",
        "length + 1 > max_length",
    ),
    Mutation(
        "15",
        "priority classes: lower first",
        "common.lua",
        "string.format('%010d', 1000000000 - prio)",
        "string.format('%010d', 1000000000 + prio)",
    ),
    Mutation(
        "16",
        "fair queuing: a direct admission charged blocks, not blocks / weight",
        "common.lua",
        "remember(tenant, prio, start, start + blocks / weight, weight, burst)",
        "remember(tenant, prio, start, start + blocks, weight, burst)",
    ),
    Mutation(
        "17",
        "burst credit: not divided by the weight",
        "common.lua",
        "math.max(virtual_now(prio) - burst / weight, last_finish(tenant, prio))",
        "math.max(virtual_now(prio) - burst, last_finish(tenant, prio))",
    ),
    Mutation(
        "18",
        "V: may go back (its recorded floor dropped)",
        "common.lua",
        "math.max(fair_num('vf:' .. prio), first_start(prio) or fair_num('v:' .. prio))",
        "(first_start(prio) or fair_num('v:' .. prio))",
    ),
    Mutation(
        "19",
        "a queued admission served without its charge",
        "common.lua",
        "remember(e.t, e.p, s, f, weight, burst)",
        "remember(e.t, e.p, s, s, weight, burst)",
    ),
    Mutation(
        "20",
        "leaving unserved: the tenant's later entries not moved back",
        "common.lua",
        "local start = math.max(tonumber(e.s), s - charge)",
        "local start = s",
    ),
    Mutation(
        "21",
        "extend: the served tag moved on from F alone, not max(V, F)",
        "extend.lua",
        "local start = math.max(virtual_now(l.p), fair_num(f))",
        "local start = fair_num(f)",
    ),
    Mutation(
        "22",
        "served tags forgotten once V passes F (not F + B / weight)",
        "common.lua",
        "fmt((finish + burst / weight) * (1 + MARGIN) + MARGIN)",
        "fmt(finish * (1 + MARGIN) + MARGIN)",
    ),
    Mutation(
        "23a",
        "no overtaking: a fresh ask stands before equal tags",
        "common.lua",
        "local NEWCOMER_SEQ = '9999999999999999'",
        "local NEWCOMER_SEQ = '0000000000000000'",
    ),
    Mutation(
        "23b",
        "no overtaking: entries for other engines hold an ask back too",
        "common.lua",
        "if eng.wanted(e, engines) and (passable == nil",
        "if (passable == nil",
    ),
    Mutation(
        "24a",
        "bounds: the tenant's max_queued one more",
        "enqueue.lua",
        "if cap and queued >= cap then",
        "if cap and queued > cap then",
    ),
    Mutation(
        "24b",
        "bounds: an entry waits twice its max_wait_s",
        "enqueue.lua",
        "push(id, tenant, prio, weight, engines, blocks, NOW + max_wait,",
        "push(id, tenant, prio, weight, engines, blocks, NOW + 2 * max_wait,",
    ),
    Mutation(
        "24c",
        "bounds: the line one longer than max_length",
        "enqueue.lua",
        "if redis.call('ZCARD', K_QEXP) >= max_length then",
        "if redis.call('ZCARD', K_QEXP) > max_length then",
    ),
    Mutation(
        "24d",
        "bounds: entries expiring at once leave in the order of their expiry",
        "common.lua",
        "    table.sort(due, function(a, b) return a.m < b.m end)\n",
        "",
    ),
    Mutation(
        "25a",
        "filter: an unhealthy engine is a candidate",
        "admit.lua",
        "local room = c.healthy and c.b <= free",
        "local room = c.b <= free",
    ),
    Mutation(
        "25b",
        "filter (engine order): one sequence beyond the slots",
        "admit.lua",
        "need_f.s > slots - running then return false end",
        "need_f.s > slots - running + 1 then return false end",
    ),
    Mutation(
        "26a",
        "most_free_after: cached blocks not weighted",
        "admit.lua",
        "free - c.b + cached_weight * c.cached",
        "free - c.b + c.cached",
    ),
    Mutation(
        "26b",
        "fewest_running: most running preferred",
        "admit.lua",
        "score[i] = -running",
        "score[i] = running",
    ),
    Mutation(
        "26c",
        "lowest_kv_fraction: the highest preferred",
        "admit.lua",
        "1 - (c.cap - free) / c.cap",
        "(c.cap - free) / c.cap",
    ),
    Mutation(
        "27a",
        "tie-break: always the first of the ties",
        "admit.lua",
        "chosen = ties[(seed % #ties) + 1]",
        "chosen = ties[1]",
    ),
    Mutation(
        "27b",
        "tie-break (engine order): always the first of the part",
        "admit.lua",
        "return common(nth(parts[1], seed % ntied))",
        "return common(nth(parts[1], 0))",
    ),
    Mutation(
        "28a",
        "engine order: staged slots counted when the ask says not",
        "admit.lua",
        "local slots = k.seqs + (staged and k.staged or 0)",
        "local slots = k.seqs + k.staged",
    ),
    Mutation(
        "28b",
        "engine order: the walk stops at twice the headroom floor",
        "admit.lua",
        "floor = need_f.b + headroom * eng.min_capacity(g)",
        "floor = need_f.b + 2 * headroom * eng.min_capacity(g)",
    ),
    Mutation(
        "28c",
        "engine order: an engine's capacity without the group's KV ceiling",
        "common.lua",
        "local cap = math.floor(v.usable * ceiling) -- EngineSpec.capacity_blocks",
        "local cap = v.usable -- EngineSpec.capacity_blocks",
    ),
    Mutation(
        "29a",
        "prefix credit: the need not credited",
        "admit.lua",
        "c.b, c.pb = c.b - c.cr, math.max(0, c.pb - c.cr)",
        "c.b, c.pb = c.b, math.max(0, c.pb - c.cr)",
    ),
    Mutation(
        "29b",
        "prefix credit: expected cached not raised to the credit",
        "admit.lua",
        "c.cached = math.max(c.cached, c.cr)",
        "c.cached = c.cached",
    ),
    Mutation(
        "30",
        "ledger: a credited lease's private blocks without its credit",
        "common.lua",
        "return math.max(0, v + (l.c or 0) - (l.h and #l.h or 0))",
        "return math.max(0, v - (l.h and #l.h or 0))",
    ),
    Mutation(
        "32",
        "extend: the tenant's blocks not grown",
        "extend.lua",
        "add(K_TEN, 'k:' .. l.t, more)\n",
        "",
    ),
)


def check(mutations: tuple[Mutation, ...]) -> None:
    """Every mutation's text occurs exactly once in its file."""
    for m in mutations:
        found = (LUA / m.file).read_text().count(m.old)
        if found != 1:
            raise SystemExit(f"mutation {m.rule}: its text occurs {found} times in {m.file}")


CONTROL = Mutation("-", "none (the control: the copy as it is must pass)", "common.lua", "", "")


def run(m: Mutation, seed: str | None, select: str | None) -> tuple[str | None, float]:
    """The differential test against the scripts with `m` applied: what failed (the
    summary line's error, None if the test passed) and how long it took."""
    with tempfile.TemporaryDirectory(prefix="kvgw-mutant-") as tmp:
        lua = Path(tmp) / "lua"
        shutil.copytree(LUA, lua)
        path = lua / m.file
        if m.old:
            path.write_text(path.read_text().replace(m.old, m.new))
        args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        args += ["-p", "tests.state.mutate_lua", TEST]
        if seed is not None:
            args.append(f"--hypothesis-seed={seed}")
        if select:
            args += ["-k", select]
        started = time.monotonic()
        done = subprocess.run(
            args,
            cwd=ROOT,
            env={**os.environ, ENV: str(lua), "COLUMNS": "200"},
            capture_output=True,
            text=True,
        )
        took = time.monotonic() - started
    if done.returncode not in (0, 1):  # 1: a test failed; anything else: it did not run
        raise SystemExit(f"mutation {m.rule}: pytest exited {done.returncode}\n{done.stdout}")
    if done.returncode == 0:
        return None, took
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    if not failed:
        return "failed", took
    test = failed[0].split("::")[-1].split(" ")[0]  # the test, then its error's class
    return f"{test}: {failed[0].split(' - ', 1)[-1].split(':')[0]}", took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated rules (e.g. 9,16a)")
    p.add_argument("--seed", default=None, help="Hypothesis's seed (default: random)")
    p.add_argument("-k", dest="select", help="pytest's -k (TestLuaAndPython: the machine alone)")
    p.add_argument("--list", action="store_true", help="list the mutations, run nothing")
    args = p.parse_args()
    only = {r for r in args.only.split(",") if r}
    chosen = tuple(m for m in MUTATIONS if not only or m.rule in only)
    check(chosen)
    print("| rule | mutation | file | result |")
    print("|---|---|---|---|")
    if args.list:
        for m in chosen:
            print(f"| {m.rule} | {m.what} | {m.file} | |")
        return 0
    failed, took = run(CONTROL, args.seed, args.select)
    print(f"| - | {CONTROL.what} | | {failed or 'passed'} ({took:.0f} s) |", flush=True)
    if failed:
        return 2
    survived = 0
    for m in chosen:
        failed, took = run(m, args.seed, args.select)
        survived += failed is None
        result = f"killed: {failed}" if failed else "SURVIVED"
        print(f"| {m.rule} | {m.what} | {m.file} | {result} ({took:.0f} s) |", flush=True)
    return 1 if survived else 0


if os.environ.get(ENV):  # loaded by the child pytest as a plugin (`-p tests.state.mutate_lua`)
    from hypothesis import Phase, settings

    from gateway.state import redis as _redis

    _redis.LUA_DIR = Path(os.environ[ENV])
    # No shrinking (a failure is all this asks; shrinking a failing run of the state machine
    # takes minutes), and no example database.
    settings.register_profile("mutant", database=None, phases=[Phase.generate])
    settings.load_profile("mutant")

if __name__ == "__main__":
    raise SystemExit(main())
