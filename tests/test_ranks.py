"""The distributed tests' harness (tests/ranks.py) on gloo: a failing rank is named with what it said, a rank that
dies without reporting is named with its exit code, and a rank stuck in a collective is killed at the deadline."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from ranks import run_ranks  # noqa: E402


def _all_reduce_world(rank: int, world: int) -> None:
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2


def _second_rank_fails(rank: int, world: int) -> None:
    assert rank != 1, "rank 1 disagrees"


def _first_rank_aborts(rank: int, world: int) -> None:
    if rank == 0:
        os.abort()


def _first_rank_waits_alone(rank: int, world: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # the others never join it


def test_every_rank_reporting_ok_passes():
    run_ranks(_all_reduce_world, 3)


def test_a_failing_rank_is_named_with_its_message():
    with pytest.raises(AssertionError, match=r"(?s)rank 1: exit code 1: .*rank 1 disagrees"):
        run_ranks(_second_rank_fails, 2)


def test_a_rank_that_dies_without_a_report_is_named():
    with pytest.raises(AssertionError, match=r"rank 0: exit code -6: ended without a report"):
        run_ranks(_first_rank_aborts, 2)


def test_a_rank_stuck_in_a_collective_is_killed_at_the_deadline():
    with pytest.raises(AssertionError, match=r"rank 0: exit code -9: no report within the time allowed"):
        run_ranks(_first_rank_waits_alone, 2, timeout_s=10)
