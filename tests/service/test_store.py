"""The SQL store on a real SQLite file and a real PostgreSQL server: queue order, cursors, idempotency,
conditional status changes."""

import json
import threading
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from moetune.api.models.responses import JobStatus
from moetune.service.store import Base, IdempotencyKeyTaken, JobRow, Store


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/nested/dir/moetune.db"  # the parent directories are created
    else:
        url = request.getfixturevalue("postgres_url")
    store = Store(url)
    store.migrate()
    yield store
    store.close()


def add_job(store: Store, job_id: str, tenant="t", priority=0, status=JobStatus.queued, key=None) -> JobRow:
    row = JobRow(id=job_id, tenant=tenant, status=status.value, priority=priority, spec={}, seed=1,
                 output_uri=f"s3://o/{job_id}", result_files=[], progress={}, idempotency_key=key,
                 request_hash="h", cancel_requested=False)
    return store.create_job(row, ["Job created"])


def test_migrating_twice_is_a_no_op(store):
    store.migrate()
    assert store.ping() and store.count_by_status() == {}


def test_the_migrations_build_what_the_rows_declare(store):
    """Every table's rows (one declarative base) and the migrated schema agree, types, indexes and constraints
    included: a row changed without its migration, or a migration without its row, fails here."""
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata) == []


def test_a_job_from_before_run_configs_gets_the_one_its_request_resolves_to(tmp_path):
    """Migration 0011 gives a row stored by the old submission (its spec resolved in place: OpenAI's knobs applied,
    "auto" kept) the run config that submission makes now: what its driver runs after the upgrade."""
    import sqlalchemy as sa
    from alembic import command
    from alembic.config import Config

    from moetune.api.models.job_create import JobCreate
    from moetune.api.models.run_config import resolve_run_config
    from moetune.service.store.base import MIGRATIONS_DIR

    request = JobCreate.model_validate({
        "model": "s3://m/base", "training_file": "s3://d/t.jsonl", "hyperparameters": {"learning_rate_multiplier": 2},
        "training": {"micro_batch_size": "auto", "global_batch_size": 4}, "parallelism": {"num_workers": 2}})
    old = request.model_dump(mode="json")  # what the old resolve_spec stored: the knobs applied to `training`
    old["training"].update(learning_rate=2e-4, n_epochs=1)
    store = Store(f"sqlite:///{tmp_path}/old.db")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0010")
        conn.execute(sa.text("INSERT INTO jobs (id, tenant, status, priority, created_at, spec, seed, output_uri, "
                             "result_files, progress, cancel_requested, attempt, gpus, gpu_seconds) VALUES ('j', 't', "
                             "'queued', 0, 1.0, :spec, 7, 's3://o/j', '[]', '{}', 0, 1, 0, 0.0)"),
                     {"spec": json.dumps(old)})
    store.migrate()
    assert store.get_job("j").run_config == resolve_run_config(request, 7).model_dump(mode="json")
    store.close()


def test_next_queued_orders_by_priority_then_age(store):
    for job_id, priority in [("old-low", 0), ("old-high", 5), ("new-high", 5), ("new-low", 0), ("urgent", 9)]:
        add_job(store, job_id, priority=priority)
    add_job(store, "running-high", priority=100, status=JobStatus.running)

    assert [j.id for j in store.next_queued(10)] == ["urgent", "old-high", "new-high", "old-low", "new-low"]
    assert [j.id for j in store.next_queued(2)] == ["urgent", "old-high"]


def test_job_pages_go_newest_first_and_stay_within_the_tenant(store):
    for n in range(5):
        add_job(store, f"job-{n}")
    add_job(store, "other", tenant="someone-else")

    first, more = store.list_jobs("t", limit=2)
    assert [j.id for j in first] == ["job-4", "job-3"] and more
    second, more = store.list_jobs("t", limit=2, after=first[-1])
    assert [j.id for j in second] == ["job-2", "job-1"] and more
    last, more = store.list_jobs("t", limit=2, after=second[-1])
    assert [j.id for j in last] == ["job-0"] and not more


def test_an_idempotency_key_is_unique_per_tenant(store):
    add_job(store, "a1", key="k")
    add_job(store, "b1", tenant="other", key="k")  # another tenant may use the same key
    with pytest.raises(IdempotencyKeyTaken):
        add_job(store, "a2", key="k")
    assert store.find_by_idempotency_key("t", "k").id == "a1"
    assert store.get_job("a2") is None


def test_transitions_are_conditional_and_write_events(store):
    add_job(store, "j", status=JobStatus.running)
    assert store.transition("j", [JobStatus.running], JobStatus.cancelled, "Job cancelled")
    assert not store.transition("j", [JobStatus.running], JobStatus.succeeded, "Job succeeded")

    job = store.get_job("j")
    assert job.status == "cancelled" and job.finished_at is not None
    events, more = store.list_events("j", limit=10)
    assert [e.message for e in events] == ["Job created", "Job cancelled"] and not more
    later, _ = store.list_events("j", limit=10, after_seq=events[0].seq)
    assert [e.message for e in later] == ["Job cancelled"]


def test_a_jobs_transitions_are_told_to_its_listeners_inside_its_transaction(store):
    """What the webhook outbox relies on: a listener sees the change it is told of, and one that fails takes the
    change down with it."""
    add_job(store, "j")
    told = []
    store.transitions.subscribe(
        lambda s, job_id, what, now, **data: told.append((what, s.get(JobRow, job_id).status, data)))
    assert store.transition("j", [JobStatus.queued], JobStatus.running, "Job started")
    store.add_checkpoint("j", 10, "s3://o/j/step-10", {})
    assert told == [("running", "running", {}), ("checkpoint.created", "running", {"step_number": 10})]

    def failing(s, job_id, what, now, **data):
        raise RuntimeError("the outbox could not write")

    store.transitions.subscribe(failing)
    with pytest.raises(RuntimeError):
        store.transition("j", [JobStatus.running], JobStatus.cancelled, "Job cancelled")
    assert store.get_job("j").status == "running"
    assert [e.message for e in store.list_events("j", limit=10)[0]] == ["Job created", "Job started"]


def test_tenant_scoped_lookup_hides_other_tenants_jobs(store):
    add_job(store, "j", tenant="a")
    assert store.get_job("j", "a").id == "j"
    assert store.get_job("j", "b") is None
    # the polled GET's read: the same columns as the ORM row, as hidden from another tenant
    columns = [c.name for c in JobRow.__table__.columns]
    orm = store.get_job("j")
    assert {c: getattr(store.read_job("j", "a"), c) for c in columns} == {c: getattr(orm, c) for c in columns}
    assert store.read_job("j", "b") is None


def test_the_slots_lock_lets_one_holder_in_at_a_time(store):
    """Two holders at once (two replicas, each its own Store on the database or its file) enter one after the
    other, and each reads what the previous one wrote before it let go."""
    other = Store(store.engine.url.render_as_string(hide_password=False))
    entered = threading.Event()
    seen = []

    def second():
        entered.wait(5)
        with other.slots_locked():
            seen.append(other.get_job("first") is not None)

    thread = threading.Thread(target=second)
    thread.start()
    with store.slots_locked():
        entered.set()
        time.sleep(0.3)  # the second holder is waiting now
        add_job(store, "first")
    thread.join(10)
    assert seen == [True]
    other.close()
