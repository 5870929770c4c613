"""Uploaded data files (POST /v1/files): their records; their bytes live in the operator's bucket."""

from __future__ import annotations

import time

from sqlalchemy import BigInteger, Float, Index, Integer, String, Text, delete, or_, select
from sqlalchemy.orm import Mapped, mapped_column

from moetune.service.store.base import Base, Database


class FileRow(Base):
    """An uploaded data file; its bytes are at `uri`."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)


class Files(Database):
    def add_file(self, file: FileRow) -> FileRow:
        file.created_at = time.time()
        with self._write() as s:
            s.add(file)
        return file

    def get_file(self, file_id: str, tenant: str) -> FileRow | None:
        """The tenant's file; another tenant's is as unknown as a missing one."""
        with self._sessions() as s:
            file = s.get(FileRow, file_id)
        return file if file is not None and file.tenant == tenant else None

    def list_files(self, tenant: str, limit: int, after: FileRow | None = None,
                   purpose: str | None = None) -> tuple[list[FileRow], bool]:
        """Newest first; `after` is the last file of the previous page."""
        query = select(FileRow).where(FileRow.tenant == tenant)
        if purpose is not None:
            query = query.where(FileRow.purpose == purpose)
        if after is not None:
            query = query.where(or_(FileRow.created_at < after.created_at,
                                    (FileRow.created_at == after.created_at) & (FileRow.id < after.id)))
        return self._page(query.order_by(FileRow.created_at.desc(), FileRow.id.desc()), limit)

    def newest_files(self, limit: int) -> list[FileRow]:
        """Every tenant's, newest first (what /readyz checks storage still holds)."""
        with self._sessions() as s:
            return list(s.scalars(select(FileRow).order_by(FileRow.created_at.desc()).limit(limit)))

    def delete_file(self, file_id: str) -> None:
        with self._write() as s:
            s.execute(delete(FileRow).where(FileRow.id == file_id))
