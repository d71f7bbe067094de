"""A claim token on each delivery: only the sender holding the claim records its result.

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("deliveries") as batch:
        batch.add_column(sa.Column("claim", sa.String(32)))


def downgrade() -> None:
    with op.batch_alter_table("deliveries") as batch:
        batch.drop_column("claim")
