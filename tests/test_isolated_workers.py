"""The isolated workers' hang guard (tests/helpers/interpreter_shim.py) is not a speed check: a test
whose worker keeps using CPU runs as long as it needs; one whose worker sits idle is stopped."""
import time

import pytest

import interpreter_shim
from interpreter_shim import isolated

worker = isolated(interpret=False)


@worker
def busy_for(seconds):
    end, x = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        x += 1
    return x > 0


@worker
def idle_for(seconds):
    time.sleep(seconds)
    return True


def test_a_busy_test_outlives_the_idle_limit_and_an_idle_one_is_stopped(monkeypatch):
    monkeypatch.setattr(interpreter_shim, "WORKER_IDLE_S", 3)
    monkeypatch.setattr(interpreter_shim, "WORKER_POLL_S", 0.5)
    assert busy_for(8)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="used no CPU for 3 s: it hangs"):
        idle_for(20)
    assert time.monotonic() - start < 30
    assert busy_for(0.1), "a new worker serves the tests after a hung one"
