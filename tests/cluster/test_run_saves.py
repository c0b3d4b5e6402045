"""Saved weights of training runs on disk (`cluster.run_saves`): names matched whole (a trailing newline is
refused, it named another folder than the one checked), paths resolved for their tenant only, deletion
and its tombstone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coserve.cluster.run_saves import RunSaves
from coserve.contract.training_calls import CallFailure

RUN = "session-" + "a" * 24 + ":train:0"


@pytest.fixture
def saves(tmp_path: Path) -> RunSaves:
    (tmp_path / RUN).mkdir()
    (tmp_path / RUN / "run.json").write_text(json.dumps({"tenant": "alice"}))
    (tmp_path / RUN / "sampler_weights" / "final").mkdir(parents=True)
    (tmp_path / RUN / "sampler_weights" / "final" / "adapter_model.safetensors").write_bytes(b"x" * 100)
    return RunSaves(tmp_path)


@pytest.mark.parametrize("name", ["final\n", "a/b", "..", "", ".hidden", "x" * 129, "ok\n\n", "é"])
def test_names_are_matched_whole(saves: RunSaves, name: str) -> None:
    refusal = saves.check_name(RUN, name, resumable=False)
    assert isinstance(refusal, CallFailure) and refusal.code == "invalid_name"
    assert saves.check_name(RUN, "step-1.final_2", resumable=True) is None


def test_a_path_resolves_for_its_tenant_only(saves: RunSaves, tmp_path: Path) -> None:
    path = f"tinker://{RUN}/sampler_weights/final"
    assert saves.resolve_path("alice", path) == tmp_path / RUN / "sampler_weights" / "final"
    for tenant, asked in (("bob", path), ("alice", path + "\n"), ("alice", path.replace("final", "../final"))):
        found = saves.resolve_path(tenant, asked)
        assert isinstance(found, CallFailure), (tenant, asked)


def test_a_deleted_save_is_gone_and_its_name_is_not_used_again(saves: RunSaves, tmp_path: Path) -> None:
    assert isinstance(saves.delete("bob", RUN, "sampler_weights/final"), CallFailure)  # another tenant's
    assert isinstance(saves.delete("alice", RUN, "sampler_weights/final\n"), CallFailure)
    assert saves.delete("alice", RUN, "sampler_weights/final") == f"tinker://{RUN}/sampler_weights/final"
    assert not (tmp_path / RUN / "sampler_weights" / "final").exists()
    refusal = saves.check_name(RUN, "final", resumable=False)
    assert isinstance(refusal, CallFailure) and "deleted" in refusal.message
    assert saves.check_name(RUN, "final", resumable=True) is None  # a training state of that name is another save
    missing = saves.delete("alice", RUN, "sampler_weights/final")
    assert isinstance(missing, CallFailure) and missing.code == "checkpoint_not_found"
