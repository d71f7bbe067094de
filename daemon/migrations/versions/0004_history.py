"""History: the watched series and their per-minute aggregates.

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "history_series",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("sample", sa.String(200), nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.UniqueConstraint("sample", "labels", name="history_series_key"),
    )
    op.create_table(
        "history_minutes",
        sa.Column("series_id", sa.Integer, sa.ForeignKey("history_series.id"),
                  primary_key=True),
        sa.Column("minute", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("total", sa.Float, nullable=False),
        sa.Column("vmin", sa.Float),
        sa.Column("vmax", sa.Float),
        sa.Column("vlast", sa.Float),
    )
    op.create_index("history_minutes_minute", "history_minutes", ["minute"])
    op.create_index("deliveries_finished_at", "deliveries", ["finished_at"])


def downgrade() -> None:
    op.drop_index("deliveries_finished_at", "deliveries")
    op.drop_table("history_minutes")
    op.drop_table("history_series")
