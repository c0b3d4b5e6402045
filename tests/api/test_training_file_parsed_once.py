"""A training file is parsed once, at upload: the gateway keeps what it read (`contract.training_rows`) beside
the file's bytes, and creating a job and preparing it read that, not the bytes again (the strict reader and the
row checks run once per upload). A file uploaded before the server kept parsed rows (its `.parsed.json` gone)
still trains: it is parsed once more when a job names it, and kept so. Through the real server and the official
client; the strict reader's calls are counted where the gateway and the job manager call it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import coserve.api.protocol.files as upload_check
import coserve.jobs.preparation as preparation
from local_server import LocalServer, local_server, poll_job, upload_jsonl

KEY = "sk-parsed-once-0123456789"
LINES = [{"messages": [{"role": "user", "content": f"Say the number {i} \u00e9\u4e2d"},
                       {"role": "assistant", "content": f"The number is {i}."}]} for i in range(12)]


@pytest.fixture(scope="module")
def served(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalServer, Path]]:
    root = tmp_path_factory.mktemp("parsed-once")
    with local_server(llama_dir, root, {"acme": {"api_keys": [KEY]}}) as srv:
        yield srv, root / "data" / "files"


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of `module.name` (the reader as that module calls it)."""
    calls: list[int] = []
    real: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _train(server: LocalServer, file_id: str) -> str:
    oa = server.client(KEY)
    job = oa.fine_tuning.jobs.create(model=server.base, training_file=file_id,
                                     hyperparameters={"n_epochs": 1, "batch_size": 4})
    return poll_job(oa, job.id, timeout=120).status


def test_a_file_is_read_at_upload_and_never_again(served: tuple[LocalServer, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    server, files = served
    at_upload = _counting(monkeypatch, upload_check, "jsonl_rows")
    at_preparation = _counting(monkeypatch, preparation, "read_rows")
    file_id = upload_jsonl(server.client(KEY), LINES)
    assert len(at_upload) == 1 and (files / f"{file_id}.parsed.json").is_file()
    assert _train(server, file_id) == "succeeded"
    assert len(at_upload) == 1 and not at_preparation  # creating and preparing the job read the parsed rows
    server.client(KEY).files.delete(file_id)
    assert not (files / f"{file_id}.parsed.json").exists() and not (files / file_id).exists()


def test_a_file_uploaded_before_parsed_rows_were_kept_still_trains(served: tuple[LocalServer, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    server, files = served
    file_id = upload_jsonl(server.client(KEY), LINES)
    (files / f"{file_id}.parsed.json").unlink()  # as a file stored by an earlier coserve
    at_upload = _counting(monkeypatch, upload_check, "jsonl_rows")
    at_preparation = _counting(monkeypatch, preparation, "read_rows")
    assert _train(server, file_id) == "succeeded"
    assert len(at_upload) == 1 and not at_preparation  # parsed once, when the job named it, and kept
    assert (files / f"{file_id}.parsed.json").is_file()
    assert _train(server, file_id) == "succeeded" and len(at_upload) == 1  # a second job reads what was kept
