"""the scheduler's leader lease (one row, its epoch the fencing token) and the jobs' GPU use for tenant quotas

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    lease = op.create_table(
        "leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(128)),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )
    op.bulk_insert(lease, [{"name": "scheduler", "holder": None, "epoch": 0, "expires_at": 0.0}])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("gpus", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("gpu_seconds", sa.Float, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("gpu_seconds")
        batch.drop_column("gpus")
    op.drop_table("leases")
