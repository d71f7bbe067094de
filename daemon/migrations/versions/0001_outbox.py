"""The webhook outbox: deliveries, their attempts, receivers disabled by a 410.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deliveries",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("receiver", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("last_status", sa.Integer),
        sa.Column("last_error", sa.Text),
        sa.Column("finished_at", sa.Float),
    )
    op.create_index("deliveries_due", "deliveries", ["state", "next_attempt_at"])
    op.create_table(
        "delivery_attempts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("delivery_id", sa.String(64), sa.ForeignKey("deliveries.id"), nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("status", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("seconds", sa.Float, nullable=False),
    )
    op.create_index("delivery_attempts_of", "delivery_attempts", ["delivery_id"])
    op.create_table(
        "disabled_receivers",
        sa.Column("receiver", sa.String(200), primary_key=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("disabled_receivers")
    op.drop_table("delivery_attempts")
    op.drop_table("deliveries")
