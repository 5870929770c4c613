"""a job's run config (api/models/run_config.py): what its workers run, resolved once at submission from the request
(the `spec` column, as posted); rows from before it get theirs from their spec, which submission had resolved

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_SECTIONS = ("model", "training_file", "validation_file", "lora", "parallelism", "method", "evaluation")


def _run_config(spec: dict, seed: int) -> dict:
    """The run config of a row whose spec had OpenAI's knobs applied already (the old resolve_spec): only its
    `"auto"`s are left to resolve, as api.models.run_config.resolve_run_config does without a plan."""
    training = dict(spec.get("training") or {})
    micro_batch = training.get("micro_batch_size", 1)
    training["tune_micro_batch"] = micro_batch == "auto"
    training["micro_batch_size"] = 1 if micro_batch == "auto" else micro_batch
    if training.get("activation_checkpointing", "auto") == "auto":
        training["activation_checkpointing"] = (spec.get("parallelism") or {}).get("gpus_per_worker", 0) > 0
    return {**{key: spec.get(key) for key in _SECTIONS}, "seed": seed, "training": training}


def upgrade() -> None:
    op.add_column("jobs", sa.Column("run_config", sa.JSON, nullable=True))
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("spec", sa.JSON), sa.column("seed", sa.BigInteger),
                    sa.column("run_config", sa.JSON))
    bind = op.get_bind()
    for job_id, spec, seed in bind.execute(sa.select(jobs.c.id, jobs.c.spec, jobs.c.seed)).all():
        bind.execute(jobs.update().where(jobs.c.id == job_id).values(run_config=_run_config(spec, seed)))


def downgrade() -> None:
    op.drop_column("jobs", "run_config")
