"""accounts: users, API keys, auth tokens, audit events; models gain owner and shared

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:00:00

The demo model row (``stories260K``) is marked shared. Rows whose ``owner`` is NULL keep it
until the first admin is created (``app.studio.first_start.claim_unowned`` gives them to that admin).
"""
from alembic import op
import sqlalchemy as sa
import sqlmodel


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

_STR = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table('users',
    sa.Column('id', _STR(), nullable=False),
    sa.Column('name', _STR(), nullable=False),
    sa.Column('password_hash', _STR(), nullable=False),
    sa.Column('role', _STR(), nullable=False),
    sa.Column('disabled', sa.Boolean(), nullable=False),
    sa.Column('can_run_custom_rewards', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('last_seen_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_users_name'), ['name'], unique=True)

    op.create_table('api_keys',
    sa.Column('id', _STR(), nullable=False),
    sa.Column('user_id', _STR(), nullable=False),
    sa.Column('name', _STR(), nullable=False),
    sa.Column('prefix', _STR(), nullable=False),
    sa.Column('key_hash', _STR(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('last_used_at', sa.Float(), nullable=True),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_user_id'), ['user_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_api_keys_key_hash'), ['key_hash'], unique=True)

    op.create_table('auth_tokens',
    sa.Column('id', _STR(), nullable=False),
    sa.Column('token_hash', _STR(), nullable=False),
    sa.Column('user_id', _STR(), nullable=False),
    sa.Column('kind', _STR(), nullable=False),
    sa.Column('csrf_token', _STR(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('auth_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_auth_tokens_token_hash'), ['token_hash'], unique=True)
        batch_op.create_index(batch_op.f('ix_auth_tokens_user_id'), ['user_id'], unique=False)

    op.create_table('audit_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('user_id', _STR(), nullable=True),
    sa.Column('action', _STR(), nullable=False),
    sa.Column('object_type', _STR(), nullable=True),
    sa.Column('object_id', _STR(), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_audit_events_ts'), ['ts'], unique=False)
        batch_op.create_index(batch_op.f('ix_audit_events_user_id'), ['user_id'], unique=False)

    # Plain ADD COLUMNs (a string server default keeps SQLite's batch mode from recreating
    # the table, which foreign keys from runs would refuse).
    with op.batch_alter_table('models', schema=None) as batch_op:
        batch_op.add_column(sa.Column('owner', _STR(), nullable=True))
        batch_op.add_column(sa.Column('shared', sa.Boolean(), nullable=False, server_default='0'))

    op.get_bind().execute(sa.text("UPDATE models SET shared = :yes WHERE name = :demo")
                          .bindparams(sa.bindparam('yes', True, sa.Boolean()),
                                      demo='stories260K'))


def downgrade() -> None:
    for column in ('shared', 'owner'):  # SQLite >= 3.35 drops columns in place, like Postgres
        op.execute(f'ALTER TABLE models DROP COLUMN {column}')
    for table, indexes in (('audit_events', ('ix_audit_events_user_id', 'ix_audit_events_ts')),
                           ('auth_tokens', ('ix_auth_tokens_user_id', 'ix_auth_tokens_token_hash')),
                           ('api_keys', ('ix_api_keys_key_hash', 'ix_api_keys_user_id')),
                           ('users', ('ix_users_name',))):
        with op.batch_alter_table(table, schema=None) as batch_op:
            for ix in indexes:
                batch_op.drop_index(ix)
        op.drop_table(table)
