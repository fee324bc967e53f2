"""Admission with one tenant per robot: a fleet's robots in tenants of their own are admitted as
one tenant's would be (issue 32, item 4)."""

from __future__ import annotations

import pytest

from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Admitted, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry

#: Armory's L40S batch-latency curve (seconds per batch of 1-5).
L40S = {1: 0.073, 2: 0.1098, 3: 0.1424, 4: 0.1775, 5: 0.2111}


def _offer_ten(tenants: int) -> list[Admitted | object]:
    names = [f"robot{i}" for i in range(tenants)]
    reg = TenantRegistry({n: TenantInfo(n) for n in names})
    svc = ServiceTimeModel(deviation_factor=0.0, initial=L40S)
    c = AdmissionController("m", QuotaManager(reg), AdmissionConfig(max_batch_size=3), svc)
    return [c.offer(Request(i, f"s{i}", names[i % tenants], "policy", PolicyCost(), 1.0, 0), 0.0) for i in range(10)]


@pytest.mark.parametrize("tenants", [1, 2, 10])
def test_ten_robots_at_once_are_admitted_whatever_their_tenants(tenants: int) -> None:
    # Ten requests at once with 1 s budgets: four batches of at most three take under 0.6 s.
    out = _offer_ten(tenants)
    assert all(isinstance(d, Admitted) for d in out), out


def test_ten_tenants_get_one_tenants_predictions() -> None:
    one = [d.predicted_completion for d in _offer_ten(1) if isinstance(d, Admitted)]
    ten = [d.predicted_completion for d in _offer_ten(10) if isinstance(d, Admitted)]
    assert ten == pytest.approx(one)
