"""webhook endpoints and the webhook delivery outbox (placeholder: the revision chain is fixed first, the tables follow)

Revision ID: 0004
Revises: 0003
"""

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
