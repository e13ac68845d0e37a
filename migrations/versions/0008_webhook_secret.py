"""users.webhook_secret: the key that signs a user's webhook deliveries (trial finding)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 19:00:00

A ``whsec_...`` secret (Standard Webhooks) made when the webhook URL is set and shown to the user
once (app.studio.notify.set_webhook); the worker signs each delivery with it (HMAC-SHA256 of
id.timestamp.body, worker/notify.py). It must be kept as it is (not hashed) to sign. URLs set
before this revision have none: the worker does not send to them until the user saves the
webhook again (and so gets a secret to verify with).
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.add_column(sa.Column('webhook_secret', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.drop_column('webhook_secret')
