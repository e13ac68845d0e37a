"""users.webhook_url: where a user's run ends are POSTed (issue 16, notify)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 16:30:00

An optional http(s) URL set on the account page (app.studio.accounts.set_webhook); when a run's
training job succeeds, fails or is cancelled the worker POSTs JSON about it there
(worker/notify.py).
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.add_column(sa.Column('webhook_url', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.drop_column('webhook_url')
