"""files (uploads of POST /v1/files) and jobs.queue_reason (why a queued job waits)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("rows", sa.Integer, nullable=False),
        sa.Column("uri", sa.Text, nullable=False),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant", "created_at"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("queue_reason", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("queue_reason")
    op.drop_index("ix_files_tenant_created", "files")
    op.drop_table("files")
