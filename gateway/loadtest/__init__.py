"""`kv-gateway loadtest`: the load-test and tuning tool (run, compare, sweep).

Pure parts (lengths, arrivals, workload, retry, aggregate) take time and randomness as
arguments; I/O lives in client, scrape, runner, targets, setups and the commands. See
docs/loadtest.md.
"""
