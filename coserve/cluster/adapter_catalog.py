"""`AdapterCatalog`: the adapters fine-tuning jobs wrote (checkpoints, final), and where each may load.

A job trains on one engine, but what it writes is served by every engine: each checkpoint and the final
adapter is *published* to all engines the moment its save is confirmed, so a request for the fine-tuned
model can go to any engine (the router picks by load and affinity) and that engine's planner loads it
into a slot like any adapter.

Delivery: the engine that trained the job wrote the files, so it has them at once. The others have
them at once too on shared storage (one node, or a shared file system: `shared_storage=True`, the
in-process drivers and the simulator); otherwise each `Publication` names the engines the files must
be copied to, and `delivered` marks an engine once they are there (the server's part). Until then the
router keeps the adapter's requests on engines that have it. An engine that joins later is owed every
publication so far (`add_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Publication:
    """One adapter a job wrote, and the engines it must still reach (empty on shared storage)."""

    job_id: str
    path: str
    step: int
    final: bool
    to_deliver: tuple[str, ...]


class AdapterCatalog:
    """Published adapters by path, and the engines that have each (module docstring).

    Args:
        shared_storage: every engine reads the same files (delivery is immediate).
    """

    def __init__(self, shared_storage: bool = True) -> None:
        self._shared = shared_storage
        self._engines: list[str] = []
        self._have: dict[str, set[str]] = {}  # path -> engines that have the files
        self._published: dict[str, Publication] = {}
        self._new: list[Publication] = []

    def add_engine(self, engine_id: str) -> list[Publication]:
        """A new (or restarted) engine; returns the publications it must receive (none when shared)."""
        if engine_id not in self._engines:
            self._engines.append(engine_id)
        owed = []
        for path, have in self._have.items():
            if self._shared:
                have.add(engine_id)
            elif engine_id not in have:
                owed.append(self._published[path])
        return owed

    def remove_engine(self, engine_id: str) -> None:
        """A lost engine: it no longer serves anything it had."""
        if engine_id in self._engines:
            self._engines.remove(engine_id)
        for have in self._have.values():
            have.discard(engine_id)

    def publish(self, job_id: str, path: str, step: int, final: bool, written_on: str) -> Publication:
        """Publish the adapter a job saved at `path` on engine `written_on` to every engine."""
        have = {written_on} if not self._shared else set(self._engines) | {written_on}
        self._have[path] = have
        publication = Publication(job_id, path, step, final,
                                  tuple(e for e in self._engines if e not in have))
        self._published[path] = publication
        self._new.append(publication)
        return publication

    def delivered(self, path: str, engine_id: str) -> None:
        """The files of `path` reached `engine_id` (a live engine).

        Raises:
            KeyError: nothing was published at `path`.
        """
        if engine_id in self._engines:
            self._have[path].add(engine_id)

    def engines_for(self, path: str) -> frozenset[str] | None:
        """The engines that may load the adapter at `path`; None: any engine (not a job's adapter, or
        none of the engines that had it is left)."""
        have = self._have.get(path)
        return frozenset(have) if have else None

    def pop_publications(self) -> list[Publication]:
        """Publications since the last call, oldest first."""
        new, self._new = self._new, []
        return new
