"""worker reports carry an idempotency key (their outbox stream and sequence number): the newest accepted per stream,
so a redelivered report is acknowledged without being stored twice

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "report_streams",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("stream", sa.String(64), primary_key=True),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("report_streams")
