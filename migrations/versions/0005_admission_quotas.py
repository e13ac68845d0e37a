"""admission and quotas: jobs gain their GPU reservation and front_at; users gain quotas and a
fair-share weight; workers gain a GPU slot's index and capacity

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 16:00:00

All nullable (share_weight defaults to 1): existing jobs hold no reservation, existing users have
no limits, existing worker rows are re-registered by their process at its next start.
"""
from alembic import op
import sqlalchemy as sa
import sqlmodel


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

_STR = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_slot', _STR(), nullable=True))
        batch_op.add_column(sa.Column('gpu_index', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('admitted_gib', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('front_at', sa.Float(), nullable=True))
        batch_op.create_index(batch_op.f('ix_jobs_gpu_slot'), ['gpu_slot'], unique=False)
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.add_column(sa.Column('quota_jobs', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('quota_gib', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('quota_gpu_hours', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('share_weight', sa.Float(), nullable=False,
                                      server_default='1.0'))
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_index', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('gpu_capacity_gib', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('gpu_capacity_gib')
        batch_op.drop_column('gpu_index')
    with op.batch_alter_table('users', schema=None) as batch_op:
        for column in ('share_weight', 'quota_gpu_hours', 'quota_gib', 'quota_jobs'):
            batch_op.drop_column(column)
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_gpu_slot'))
        for column in ('front_at', 'admitted_gib', 'gpu_index', 'gpu_slot'):
            batch_op.drop_column(column)
