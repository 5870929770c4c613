"""The control plane's persistence (SQLAlchemy 2; SQLite by default, PostgreSQL in production): every table's rows
on one declarative base (base.py), which the migrations target, and the Store, whose parts are one module per
concern: jobs, their events and checkpoints, leases, files. The session, webhook and deployment tables' queries
live with their rooms (service/sessions, service/webhooks, service/cluster); their rows are here, so the metadata
is whole wherever the store is imported. Nothing here imports a module of the control plane above it: what must
happen with a job's change (the webhook outbox) subscribes to its transitions (transitions.py)."""

from moetune.service.store.base import Base
from moetune.service.store.deployments import DeployedBaseRow
from moetune.service.store.events import CheckpointRow, Events, ReportKey, ReportStreamRow
from moetune.service.store.files import FileRow, Files
from moetune.service.store.jobs import ACTIVE_STATUSES, SLOT_STATUSES, EventRow, IdempotencyKeyTaken, JobRow, Jobs
from moetune.service.store.leases import SCHEDULER_LEASE, SLOTS_LOCK, LeaseRow, Leases
from moetune.service.store.sessions import CallRow, SessionRow
from moetune.service.store.webhooks import DeliveryRow, EndpointRow


class Store(Jobs, Events, Leases, Files):
    """One database's jobs, events, checkpoints, leases and files (see each part's module)."""


__all__ = [
    "ACTIVE_STATUSES", "SCHEDULER_LEASE", "SLOTS_LOCK", "SLOT_STATUSES", "Base", "CallRow",
    "CheckpointRow", "DeliveryRow", "DeployedBaseRow", "EndpointRow", "EventRow", "FileRow", "IdempotencyKeyTaken",
    "JobRow", "LeaseRow", "ReportKey", "ReportStreamRow", "SessionRow", "Store",
]
