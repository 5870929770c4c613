"""The bases the Serve app was asked to serve (migration 0010); service/cluster/deployments.py records them and
deploys them again when Serve lost them."""

from __future__ import annotations

from sqlalchemy import Float, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from moetune.service.store.base import Base


class DeployedBaseRow(Base):
    """A base the Serve app was asked to serve (its tuned models' adapters load on first use, so the bases are
    the whole of what a deployment is)."""

    __tablename__ = "deployed_bases"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    deployed_at: Mapped[float] = mapped_column(Float)
