"""An alert instance keeps the labels and annotations its notifications carried, so the
daemon can resolve it after its rule was removed or changed.

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("alert_instances") as batch:
        batch.add_column(sa.Column("alert_labels", sa.Text))
        batch.add_column(sa.Column("annotations", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("alert_instances") as batch:
        batch.drop_column("annotations")
        batch.drop_column("alert_labels")
