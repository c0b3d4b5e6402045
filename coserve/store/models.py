"""Servable models: base models (no tenant, visible to everyone) and tenants' fine-tuned adapters.

A deleted model keeps its row (flagged): its id is never handed out again, because engines cache
adapters by name and a reused name could serve the old weights (ref. D3). Its adapter folder goes from
disk: the row is flagged first, then the folder removed, so a crash in between leaves only a folder no
row serves, which the next open removes (`UsageTable.sweep_deleted`).
"""

from __future__ import annotations

from coserve.store._base import Database, check_tenant, from_row
from coserve.store.records import ModelRecord
from coserve.store.usage import UsageTable

_NO_JSON: frozenset[str] = frozenset()
_MODEL_CONVERT = {"deleted": bool}


class ModelTable:
    """Register, read, list and delete models."""

    def __init__(self, db: Database, usage: UsageTable) -> None:
        self._db, self._usage = db, usage

    def register(self, model_id: str, *, tenant: str | None, base_model: str | None = None,
                       adapter_path: str | None = None, job_id: str | None = None) -> ModelRecord:
        """Record a servable model (write its adapter to disk first: it is servable once this returns).

        Args:
            model_id: the public id (`ft:{base}:{tenant}:{suffix}:{id}` for fine-tuned models).
            tenant: owner of a fine-tuned model; None for a base model.
            base_model: the base a fine-tuned model's adapter applies to.

        Raises:
            ValueError: empty id or tenant, or the id exists (even deleted: ids are never reused).
        """
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
        if tenant is not None:
            check_tenant(tenant)
        record = ModelRecord(id=model_id, tenant=tenant, base_model=base_model, created_at=self._db.now(),
                             adapter_path=adapter_path, job_id=job_id)
        with self._db.write() as conn:
            if conn.execute("SELECT 1 FROM models WHERE id = ?", (model_id,)).fetchone() is not None:
                raise ValueError(f"model id {model_id!r} already exists (ids are never reused)")
            conn.execute("INSERT INTO models (id, tenant, base_model, created_at, adapter_path, job_id) "
                         "VALUES (?, ?, ?, ?, ?, ?)",
                         (model_id, tenant, base_model, record.created_at, adapter_path, job_id))
        return record

    def ensure_base(self, model_id: str) -> ModelRecord:
        """Register base model `model_id` unless it already is (server start-up calls this every time).

        Raises:
            ValueError: `model_id` names a tenant's fine-tuned model.
        """
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
        with self._db.write() as conn:
            # Check and insert in one transaction: two callers at start-up cannot both insert.
            row = conn.execute("SELECT * FROM models WHERE id = ?", (model_id,)).fetchone()
            if row is None:
                conn.execute("INSERT INTO models (id, tenant, created_at) VALUES (?, NULL, ?)",
                             (model_id, self._db.now()))
                row = conn.execute("SELECT * FROM models WHERE id = ?", (model_id,)).fetchone()
        record = from_row(ModelRecord, row, _NO_JSON, _MODEL_CONVERT)
        if record.tenant is not None:
            raise ValueError(f"model id {model_id!r} is a fine-tuned model, not a base model")
        return record

    def get(self, tenant: str, model_id: str) -> ModelRecord | None:
        """The model `model_id` if `tenant` may use it (a base model or its own); None otherwise."""
        with self._db.read() as conn:
            row = conn.execute("SELECT * FROM models WHERE id = ? AND deleted = 0 "
                               "AND (tenant IS NULL OR tenant = ?)", (model_id, tenant)).fetchone()
        return None if row is None else from_row(ModelRecord, row, _NO_JSON, _MODEL_CONVERT)

    def usable(self, tenant: str) -> list[ModelRecord]:
        """The models `tenant` may use: base models first, then its own in creation order."""
        with self._db.read() as conn:
            rows = conn.execute("SELECT * FROM models WHERE deleted = 0 AND (tenant IS NULL OR tenant = ?) "
                                "ORDER BY tenant IS NOT NULL, seq", (tenant,)).fetchall()
        return [from_row(ModelRecord, row, _NO_JSON, _MODEL_CONVERT) for row in rows]

    def delete(self, tenant: str, model_id: str) -> bool:
        """Delete `tenant`'s fine-tuned model and its adapter folder; False when `tenant` has no such model
        (base models included)."""
        with self._db.write() as conn:
            row = conn.execute("SELECT adapter_path FROM models WHERE id = ? AND tenant = ? AND deleted = 0",
                               (model_id, tenant)).fetchone()
            if row is None:
                return False
            conn.execute("UPDATE models SET deleted = 1 WHERE id = ?", (model_id,))
        self._usage.remove_adapter(row[0])
        return True
