"""A session's rows: the session and its status, its calls as a queue the group takes from oldest first. Status
changes are conditional updates, as the jobs' are (service/store/jobs.py), so user calls and the group's reports race
safely. Each worker group the session starts is a row among its calls too (kind `group`, never taken): when it was
submitted and what it resumed from, which later groups and the start timeout read."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

from sqlalchemy import func, select, update

from moetune.api.models.training_sessions import OPEN_STATUSES, Sample
from moetune.service.store import CallRow, SessionRow

if TYPE_CHECKING:
    from moetune.service.store import Store

PENDING, RUNNING, SUCCEEDED, FAILED = "pending", "running", "succeeded", "failed"
GROUP = "group"  # a worker group's start, recorded among the calls
MERGED_CALLS = 64  # the most samples taken as one generation, and
MERGED_SEQUENCES = 256  # the most sequences it draws (vLLM's default batch: max_num_seqs)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def add_session(store: Store, row: SessionRow) -> SessionRow:
    with store._write() as s:
        s.add(row)
    return row


def get_session(store: Store, session_id: str, tenant: str | None = None) -> SessionRow | None:
    """The session; another tenant's is as unknown as a missing one."""
    with store._sessions() as s:
        row = s.get(SessionRow, session_id)
    return row if row is not None and (tenant is None or row.tenant == tenant) else None


def list_sessions(store: Store, tenant: str, limit: int) -> tuple[list[SessionRow], bool]:
    query = select(SessionRow).where(SessionRow.tenant == tenant)
    return store._page(query.order_by(SessionRow.created_at.desc(), SessionRow.id.desc()), limit)


def sessions_with_status(store: Store, status: str) -> list[SessionRow]:
    """Every tenant's sessions in `status`."""
    with store._sessions() as s:
        return list(s.scalars(select(SessionRow).where(SessionRow.status == status)))


def set_session(store: Store, session_id: str, only_if: tuple[str, ...], group: int | None = None,
                **values) -> bool:
    """Updates the session if its status is one of `only_if` (and, given, its current group is `group`)."""
    query = update(SessionRow).where(SessionRow.id == session_id, SessionRow.status.in_(only_if))
    if group is not None:
        query = query.where(SessionRow.attempt == group)
    with store._write() as s:
        return s.execute(query.values(**values)).rowcount == 1


def count_by_status(store: Store) -> dict[str, int]:
    with store._sessions() as s:
        return dict(s.execute(select(SessionRow.status, func.count()).group_by(SessionRow.status)).all())


def add_call(store: Store, session_id: str, kind: str, args: dict) -> CallRow:
    row = CallRow(id=new_id("call"), session_id=session_id, kind=kind, args=args, status=PENDING,
                  created_at=time.time())
    with store._write() as s:
        s.add(row)
    return row


def get_call(store: Store, session_id: str, call_id: str) -> CallRow | None:
    with store._sessions() as s:
        row = s.scalar(select(CallRow).where(CallRow.id == call_id))
    return row if row is not None and row.session_id == session_id else None


def take_calls(store: Store, session_id: str, attempt: int) -> list[tuple[CallRow, int]]:
    """The oldest pending call, now running on group `attempt`, with its number in the session (1-based); a sample
    takes the samples queued right after it that can run in the same generation (Sample.mergeable), up to
    MERGED_CALLS calls and MERGED_SEQUENCES sequences: an RL step's many concurrent samples become one call on the
    group."""
    with store._write() as s:
        pending = list(s.scalars(select(CallRow).where(CallRow.session_id == session_id, CallRow.status == PENDING)
                                 .order_by(CallRow.seq).limit(MERGED_CALLS)))
        if not pending:
            return []
        taken, sequences = pending[:1], _sequences(pending[0])
        for row in pending[1:] if pending[0].kind == "sample" else ():
            sequences += _sequences(row)
            if row.kind != "sample" or not Sample.mergeable(pending[0].args, row.args) or sequences > MERGED_SEQUENCES:
                break
            taken.append(row)
        first = s.scalar(select(func.count()).where(CallRow.session_id == session_id, CallRow.seq <= taken[0].seq,
                                                    CallRow.kind != GROUP))
        between = list(s.scalars(select(CallRow.seq).where(CallRow.session_id == session_id, CallRow.kind != GROUP,
                                                          CallRow.seq > taken[0].seq, CallRow.seq <= taken[-1].seq)
                                 .order_by(CallRow.seq)))
        for row in taken:
            row.status, row.attempt = RUNNING, attempt
    numbers = [first] + [first + 1 + between.index(row.seq) for row in taken[1:]]
    return list(zip(taken, numbers))


def _sequences(row: CallRow) -> int:
    return len(row.args["prompts"]) * row.args["n"] if row.kind == "sample" else 0


def finish_call(store: Store, call_id: str, attempt: int, result: dict | None, error: dict | None) -> bool:
    """Records a running call's outcome from the group that took it (a replaced group's word is dropped)."""
    with store._write() as s:
        return s.execute(update(CallRow).where(CallRow.id == call_id, CallRow.status == RUNNING,
                                               CallRow.attempt == attempt)
                         .values(status=FAILED if error else SUCCEEDED, result=result, error=error,
                                 finished_at=time.time())).rowcount == 1


def fail_calls(store: Store, session_id: str, statuses: tuple[str, ...], error: dict,
               result: dict | None = None) -> None:
    """Ends the session's calls in `statuses` with `error` (a group lost mid-call, a session closed); `result`
    says what the caller may resume from."""
    with store._write() as s:
        s.execute(update(CallRow).where(CallRow.session_id == session_id, CallRow.status.in_(statuses))
                  .values(status=FAILED, error=error, result=result, finished_at=time.time()))


def succeeded_calls(store: Store, kind: str, tenant: str, session_id: str | None = None) -> list[CallRow]:
    """The tenant's succeeded calls of `kind` (in one session, given), newest first."""
    query = select(CallRow).join(SessionRow, SessionRow.id == CallRow.session_id) \
        .where(SessionRow.tenant == tenant, CallRow.kind == kind, CallRow.status == SUCCEEDED)
    if session_id is not None:
        query = query.where(CallRow.session_id == session_id)
    with store._sessions() as s:
        return list(s.scalars(query.order_by(CallRow.seq.desc())))


def add_group(store: Store, session: SessionRow, reason: str, restored: tuple[str, int] | None) -> CallRow:
    """Records that the session's current group was submitted (now) by `reason` ("created", "restart",
    "recovery"), resuming from saved state `restored` (name, step) or from a fresh LoRA (None)."""
    now = time.time()
    row = CallRow(id=new_id("group"), session_id=session.id, kind=GROUP, status=SUCCEEDED, attempt=session.attempt,
                  created_at=now, finished_at=now, args={"reason": reason},
                  result={"restored_state": restored[0] if restored else None,
                          "restored_step": restored[1] if restored else 0})
    with store._write() as s:
        s.add(row)
    return row


def current_group(store: Store, session: SessionRow) -> CallRow | None:
    """The row of the session's current group, None while it is being submitted."""
    with store._sessions() as s:
        return s.scalar(select(CallRow).where(CallRow.session_id == session.id, CallRow.kind == GROUP,
                                              CallRow.attempt == session.attempt).order_by(CallRow.seq.desc())
                        .limit(1))


def newest_state(store: Store, session: SessionRow) -> tuple[str, int] | None:
    """The name and step of the session's newest saved state, None before its first save_state or since a group
    started from a fresh LoRA (the states saved before it are another LoRA's): of the succeeded save_states and the
    groups' starts, the latest to finish says."""
    with store._sessions() as s:
        latest = s.scalar(select(CallRow).where(CallRow.session_id == session.id, CallRow.status == SUCCEEDED,
                                                CallRow.kind.in_(("save_state", GROUP)))
                          .order_by(CallRow.finished_at.desc(), CallRow.seq.desc()).limit(1))
    if latest is None:
        return None
    if latest.kind == GROUP:
        name = latest.result["restored_state"]
        return (name, latest.result["restored_step"]) if name else None
    return latest.args["name"], latest.result["step"]


def is_open(row: SessionRow) -> bool:
    return row.status in OPEN_STATUSES
