"""model names are unique per owner, not across the whole studio

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 13:20:00

A global unique name let one user learn that another's private model existed (and kept them from
registering the same Hub model under its natural name). Names are now unique per owner; a user
names models they can see (their own first, then the shared ones).
"""
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index('ix_models_name', table_name='models')
    op.create_index('ix_models_name', 'models', ['name'], unique=False)
    op.create_index('uq_models_owner_name', 'models', ['owner', 'name'], unique=True)


def downgrade() -> None:
    op.drop_index('uq_models_owner_name', table_name='models')
    op.drop_index('ix_models_name', table_name='models')
    op.create_index('ix_models_name', 'models', ['name'], unique=True)
