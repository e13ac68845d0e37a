"""gpu_samples: per GPU utilisation, memory, temperature, power and running jobs over time

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 10:00:00

Written by each supervisor every few seconds (worker/gpu_samples.py), pruned to the last two
hours, read by the GPU dashboard (/gpus, /api/gpus).
"""
from alembic import op
import sqlalchemy as sa
import sqlmodel


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

_STR = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        'gpu_samples',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('ts', sa.Float(), nullable=False),
        sa.Column('slot', _STR(), nullable=False),
        sa.Column('host', _STR(), nullable=False),
        sa.Column('gpu_index', sa.Integer(), nullable=True),
        sa.Column('name', _STR(), nullable=False),
        sa.Column('source', _STR(), nullable=False),
        sa.Column('util_pct', sa.Float(), nullable=True),
        sa.Column('mem_used_gib', sa.Float(), nullable=True),
        sa.Column('mem_total_gib', sa.Float(), nullable=True),
        sa.Column('temp_c', sa.Float(), nullable=True),
        sa.Column('power_w', sa.Float(), nullable=True),
        sa.Column('jobs', sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_gpu_samples_ts', 'gpu_samples', ['ts'], unique=False)
    op.create_index('ix_gpu_samples_slot_ts', 'gpu_samples', ['slot', 'ts'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_gpu_samples_slot_ts', table_name='gpu_samples')
    op.drop_index('ix_gpu_samples_ts', table_name='gpu_samples')
    op.drop_table('gpu_samples')
