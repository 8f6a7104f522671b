"""The local stack leaves a core to the services beside the target (StackSpec.target_threads)."""

import pytest

from specserve.tooling import stack


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (16, 2), (None, 1)])
def test_the_target_gets_all_cores_but_one_at_most_two(monkeypatch, cores, threads):
    monkeypatch.setattr(stack.os, "cpu_count", lambda: cores)
    assert stack.local_target_threads() == threads
    assert stack.StackSpec("pair", "run").target_threads == threads
