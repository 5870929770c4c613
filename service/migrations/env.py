"""Alembic environment: runs on the connection handed over by Store.migrate (or one made from the URL). Its target
is the one declarative base of every table (tests/service/test_store.py checks that the migrations build it)."""

from alembic import context
from sqlalchemy import create_engine

from moetune.service.store import Base

config = context.config
connection = config.attributes.get("connection")


def _run(conn) -> None:
    context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:  # e.g. `alembic -x` tooling pointed at sqlalchemy.url
    with create_engine(config.get_main_option("sqlalchemy.url")).begin() as conn:
        _run(conn)
