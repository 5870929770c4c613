"""training sessions (a LoRA held by a worker group, driven call by call) and their calls, in order

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "training_sessions",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("closed_at", sa.Float),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("seed", sa.BigInteger, nullable=False),
        sa.Column("output_uri", sa.Text, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("token_hash", sa.String(64)),
        sa.Column("close_reason", sa.String(32)),
        sa.Column("error", sa.JSON),
    )
    op.create_index("ix_training_sessions_tenant_created", "training_sessions", ["tenant", "created_at"])
    op.create_table(
        "training_session_calls",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("id", sa.String(40), nullable=False, unique=True),
        sa.Column("session_id", sa.String(40),
                  sa.ForeignKey("training_sessions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("args", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float),
        sa.Column("result", sa.JSON),
        sa.Column("error", sa.JSON),
    )
    op.create_index("ix_training_session_calls_session_status", "training_session_calls",
                    ["session_id", "status", "seq"])


def downgrade() -> None:
    op.drop_index("ix_training_session_calls_session_status", "training_session_calls")
    op.drop_table("training_session_calls")
    op.drop_index("ix_training_sessions_tenant_created", "training_sessions")
    op.drop_table("training_sessions")
