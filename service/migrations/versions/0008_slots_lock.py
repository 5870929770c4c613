"""the row whose lock serializes giving out running slots and tenant quota (Store.slots_locked): two training
sessions created at once, or a session and the scheduler's start of a job, cannot both take the last place

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_leases = sa.table("leases", sa.column("name", sa.String), sa.column("holder", sa.String),
                   sa.column("epoch", sa.BigInteger), sa.column("expires_at", sa.Float))


def upgrade() -> None:
    op.bulk_insert(_leases, [{"name": "slots", "holder": None, "epoch": 0, "expires_at": 0.0}])


def downgrade() -> None:
    op.execute(_leases.delete().where(_leases.c.name == "slots"))
