"""The receive budget's bookkeeping (sans-I/O): bytes held in unfinished messages per connection,
bounded per tenant and per process, the largest holder closed first. The live replay (sessions
holding half-sent frames against a real server) is in ``test_hostile_clients.py``."""

from __future__ import annotations

import pytest

from chunkline.server.entrypoints.receive_budget import ReceiveBudget

MIB = 1 << 20


def test_holders_within_the_budget_are_left_alone() -> None:
    budget = ReceiveBudget(100 * MIB, 0.5)
    assert budget.update("a", "acme", 30 * MIB) == [] and budget.update("b", "beta", 40 * MIB) == []
    assert budget.held == 70 * MIB and budget.held_by("acme") == 30 * MIB


def test_a_tenant_past_its_share_loses_its_largest_holder_and_no_one_else() -> None:
    budget = ReceiveBudget(100 * MIB, 0.5)
    budget.update("robot", "acme", 1 * MIB)
    budget.update("big1", "mallory", 30 * MIB)
    assert budget.update("big2", "mallory", 25 * MIB) == ["big1"]  # 55 > 50: the largest of mallory's goes
    assert budget.held_by("mallory") == 25 * MIB and budget.held_by("acme") == 1 * MIB


def test_past_the_total_the_largest_holder_of_any_tenant_goes_even_for_a_small_grower() -> None:
    budget = ReceiveBudget(64 * MIB, 1.0)
    budget.update("stuck", "mallory", 63 * MIB + MIB // 2)
    # An ordinary observation arriving: the half-sent huge frame is closed, not the robot.
    assert budget.update("robot", "acme", MIB) == ["stuck"]
    assert budget.held == MIB


def test_the_grower_itself_goes_when_it_is_the_largest() -> None:
    budget = ReceiveBudget(64 * MIB, 1.0)
    budget.update("robot", "acme", MIB)
    assert budget.update("huge", "mallory", 65 * MIB) == ["huge"]
    assert budget.held == MIB


def test_completed_messages_and_closed_connections_release_their_bytes() -> None:
    budget = ReceiveBudget(64 * MIB, 1.0)
    budget.update("a", "acme", 10 * MIB)
    budget.update("a", "acme", 0)  # the message completed
    budget.update("b", "acme", 5 * MIB)
    budget.release("b")  # the connection closed
    assert budget.held == 0 and budget.held_by("acme") == 0


def test_nonsense_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ReceiveBudget(0, 0.5)
    with pytest.raises(ValueError):
        ReceiveBudget(MIB, 0.0)
