"""`serve --workers N` refuses what it cannot run, before it binds or starts anything."""

import pytest

from gateway.config import parse_config
from gateway.workers import WorkersRefused, check, worker_place

ENGINES = {"engines": [{"url": "http://127.0.0.1:1", "num_gpu_blocks": 10, "max_num_seqs": 4}]}


def test_one_worker_needs_nothing_shared():
    check(parse_config(ENGINES), 1)


def test_several_workers_need_redis():
    with pytest.raises(WorkersRefused, match=r"--workers 3 needs shared state: configure `redis:`"):
        check(parse_config(ENGINES), 3)
    check(parse_config({**ENGINES, "redis": {"url": "redis://127.0.0.1:1/0"}}), 3)


def test_zero_workers_is_refused():
    with pytest.raises(WorkersRefused, match="at least 1"):
        check(parse_config(ENGINES), 0)


def test_a_worker_knows_its_place(monkeypatch):
    monkeypatch.delenv("KVGW_WORKER", raising=False)
    assert worker_place() is None
    monkeypatch.setenv("KVGW_WORKER", "1/4:7")
    assert worker_place() == (1, 4, 7)
