"""The fleet strategy behind admission's batch chooser: admission still refuses, expires and
accounts; the strategy picks the batch (issue 32, items 4 and 5)."""

from __future__ import annotations

import dataclasses
import itertools

from chunkline.server.core.admission import AdmissionConfig, AdmissionController, Admitted, Request, ServiceTimeModel
from chunkline.server.core.quotas import PolicyCost, QuotaManager
from chunkline.server.core.tenants import TenantInfo, TenantRegistry
from chunkline.server.robot.fleet import FleetSelector, FleetStrategy, Urgency

L40S = {1: 0.073, 2: 0.1098, 3: 0.1424, 4: 0.1775, 5: 0.2111}
_ids = itertools.count(1)


@dataclasses.dataclass
class Work:
    enqueued_at: float
    urgency: Urgency | None
    robot_weight: float = 1.0
    queued_since: float | None = None


def _controller(chooser: bool) -> AdmissionController:
    reg = TenantRegistry({"fleet": TenantInfo("fleet"), "other": TenantInfo("other")})
    selector = FleetSelector(FleetStrategy(), lambda t: reg.tenants[t].weight) if chooser else None
    return AdmissionController("m", QuotaManager(reg), AdmissionConfig(max_batch_size=3),
                               ServiceTimeModel(deviation_factor=0.0, initial=L40S), selector)


def _offer(c: AdmissionController, session: str, work: Work | None, deadline: float = 1.0, tenant: str = "fleet") -> Request:
    r = Request(next(_ids), session, tenant, "policy", PolicyCost(), deadline, 0, work)
    assert isinstance(c.offer(r, 0.0), Admitted)
    return r


def test_the_weighted_robot_goes_alone_through_admission() -> None:
    c = _controller(chooser=True)
    light = [_offer(c, f"slow{i}", Work(0.0, Urgency(0.2, 8, 0.05))) for i in range(4)]
    heavy = _offer(c, "fast", Work(0.0, Urgency(0.1, 4, 0.05), robot_weight=5.0))
    batch = c.next_batch(0.0)
    assert batch == [heavy]
    assert c.running == 1 and c.queued == 4
    c.complete_batch(batch, 0.073, 0.073)
    assert len(c.next_batch(0.073)) == 3  # then a full batch of the others
    assert c.take_dropped() == [] and c.queued == 1 and light


def test_without_a_chooser_admission_picks_as_before() -> None:
    c = _controller(chooser=False)
    for i in range(4):
        _offer(c, f"slow{i}", Work(0.0, Urgency(0.2, 8, 0.05)))
    _offer(c, "fast", Work(0.0, Urgency(0.1, 4, 0.05), robot_weight=5.0))
    assert len(c.next_batch(0.0)) == 3  # earliest deadline first, a full batch


def test_expired_work_is_still_dropped_by_admission_not_chosen() -> None:
    c = _controller(chooser=True)
    short = _offer(c, "a", Work(0.0, Urgency(0.0, 8, 0.05)), deadline=0.1)
    _offer(c, "b", Work(0.0, Urgency(0.5, 8, 0.05)))
    batch = c.next_batch(0.05)  # 73 ms from 0.05 ends past 0.1: admission drops it as late
    assert short not in batch and [d.request for d in c.take_dropped()] == [short]


def test_a_request_without_urgency_is_served_by_its_deadline() -> None:
    c = _controller(chooser=True)
    plain = _offer(c, "plain", None)
    assert c.next_batch(0.0) == [plain]
