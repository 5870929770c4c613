"""training sessions count against tenant quotas (their workers, GPUs and GPU time) and recover from a failed
worker group (how many times so far)

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_COLUMNS = (("workers", sa.Integer, "0"), ("gpus", sa.Integer, "0"), ("gpu_seconds", sa.Float, "0"),
            ("recoveries", sa.Integer, "0"))


def upgrade() -> None:
    with op.batch_alter_table("training_sessions") as table:
        for name, kind, default in _COLUMNS:
            table.add_column(sa.Column(name, kind, nullable=False, server_default=default))


def downgrade() -> None:
    with op.batch_alter_table("training_sessions") as table:
        for name, _, _ in reversed(_COLUMNS):
            table.drop_column(name)
