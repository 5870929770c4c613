"""the bases the Serve app was asked to serve (service/cluster/deployments.py): the scheduler's leader deploys them
again when Serve lost them (a Ray head restart, `moetune down` / `up`)

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deployed_bases",
        sa.Column("name", sa.String(256), primary_key=True),
        sa.Column("uri", sa.Text, nullable=False),
        sa.Column("deployed_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("deployed_bases")
