"""scheduler leader lease and tenant quotas (placeholder: the revision chain is fixed first, the tables follow)

Revision ID: 0005
Revises: 0004
"""

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
