"""jobs, events, checkpoints

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Autoincrementing 64-bit keys; SQLite only autoincrements a column declared INTEGER.
_sequence_key = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("seed", sa.BigInteger, nullable=False),
        sa.Column("output_uri", sa.Text, nullable=False),
        sa.Column("fine_tuned_model", sa.Text),
        sa.Column("result_files", sa.JSON, nullable=False),
        sa.Column("trained_tokens", sa.BigInteger),
        sa.Column("error", sa.JSON),
        sa.Column("progress", sa.JSON, nullable=False),
        sa.Column("estimated_finish", sa.Float),
        sa.Column("ray_submission_id", sa.String(128)),
        sa.Column("job_token_hash", sa.String(64)),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("request_hash", sa.String(64)),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )
    op.create_index("ix_jobs_tenant_created", "jobs", ["tenant", "created_at"])
    op.create_index("ix_jobs_status_priority_created", "jobs", ["status", "priority", "created_at"])

    op.create_table(
        "events",
        sa.Column("seq", _sequence_key, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("level", sa.String(16), nullable=False),
        sa.Column("type", sa.String(16), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("data", sa.JSON),
    )
    op.create_index("ix_events_job_id", "events", ["job_id"])

    op.create_table(
        "checkpoints",
        sa.Column("seq", _sequence_key, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("step_number", sa.Integer, nullable=False),
        sa.Column("uri", sa.Text, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
    )
    op.create_index("ix_checkpoints_job_id", "checkpoints", ["job_id"])


def downgrade() -> None:
    op.drop_table("checkpoints")
    op.drop_table("events")
    op.drop_table("jobs")
