"""Scheduler: a deterministic, torch-free object over queues, the radix cache and budgets."""

from lmserver.scheduler.kv import KVManager, MemoryInvariantError
from lmserver.scheduler.policy import POLICIES, UnknownPolicyError, order_waiting
from lmserver.scheduler.req import MMSpan, Req, ReqStatus
from lmserver.scheduler.scheduler import ForwardItem, ScheduleDecision, Scheduler

__all__ = [
    "POLICIES",
    "ForwardItem",
    "KVManager",
    "MMSpan",
    "MemoryInvariantError",
    "Req",
    "ReqStatus",
    "ScheduleDecision",
    "Scheduler",
    "UnknownPolicyError",
    "order_waiting",
]
