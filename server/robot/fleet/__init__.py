"""Fleet scheduling for robot requests (sans-I/O): how urgent a request is, each robot's service
weight, and the strategy that chooses each batch for fleet value (:mod:`.strategy`)."""

from chunkline.server.robot.fleet.calendar import Reserver, RobotCalendar
from chunkline.server.robot.fleet.dispatch import FleetSelector, FleetWork
from chunkline.server.robot.fleet.strategy import FleetCandidate, FleetChoice, FleetConfig, FleetStrategy, LatencyCurve, executed_value
from chunkline.server.robot.fleet.urgency import Urgency, UrgencyBounds, UrgencyError, urgency_from_wire
from chunkline.server.robot.fleet.weights import RobotPolicies, RobotPolicy, WeightError

__all__ = [
    "FleetSelector",
    "Reserver",
    "RobotCalendar",
    "FleetWork",
    "FleetCandidate",
    "FleetChoice",
    "FleetConfig",
    "FleetStrategy",
    "LatencyCurve",
    "executed_value",
    "Urgency",
    "UrgencyBounds",
    "UrgencyError",
    "urgency_from_wire",
    "RobotPolicy",
    "RobotPolicies",
    "WeightError",
]
