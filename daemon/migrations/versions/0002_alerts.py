"""Alert instances (one per rule and label set) and their transitions.

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alert_instances",
        sa.Column("rule", sa.String(200), primary_key=True),
        sa.Column("fingerprint", sa.String(16), primary_key=True),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("active_since", sa.Float),
        sa.Column("firing_since", sa.Float),
        sa.Column("value", sa.Float),
        sa.Column("baseline", sa.Float),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "alert_transitions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("rule", sa.String(200), nullable=False),
        sa.Column("fingerprint", sa.String(16), nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("from_state", sa.String(16), nullable=False),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("value", sa.Float),
        sa.Column("baseline", sa.Float),
        sa.Column("summary", sa.Text),
    )
    op.create_index("alert_transitions_at", "alert_transitions", ["at"])


def downgrade() -> None:
    op.drop_table("alert_transitions")
    op.drop_table("alert_instances")
