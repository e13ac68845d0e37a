"""memory estimates: jobs gain estimate_gib, peak_gib, peak_kind; workers gain gpu_total_gib

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 10:00:00

All nullable: existing jobs have no estimate or measured peak, existing worker rows no GPU size
(a worker re-registers with it at its next start).
"""
from alembic import op
import sqlalchemy as sa
import sqlmodel


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

_STR = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('estimate_gib', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('peak_gib', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('peak_kind', _STR(), nullable=True))
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_total_gib', sa.Float(), nullable=True))


def downgrade() -> None:
    for table, column in (('workers', 'gpu_total_gib'), ('jobs', 'peak_kind'),
                          ('jobs', 'peak_gib'), ('jobs', 'estimate_gib')):
        op.execute(f'ALTER TABLE {table} DROP COLUMN {column}')
