"""The bubblewrap command line that runs one python grader (`bwrap`, Debian's `bubblewrap`): what the
grader's process sees and what it is.

What it sees: a root of its own, read-only, holding only the system's programs and libraries (`/usr`, with
`/bin`, `/lib`, ... as on the host) and the interpreter's own prefix (its standard library); a fresh
`/proc` of its PID namespace, a minimal `/dev`, and a bounded tmpfs at `/tmp`, its working directory and its
only writable place. No `/etc`, `/home`, `/root` (beyond the interpreter's prefix), no data dir, tenants
file or repository: they are not in its mount namespace. New PID, network, IPC and UTS namespaces (and a
cgroup namespace where the kernel has them): it sees only its own processes, and has only a loopback
interface that is down. bubblewrap's own init is PID 1 there; when it ends (the grader returned, or the
parent killed bubblewrap: `--die-with-parent`), the kernel kills every process left in the namespace.

What it is: when the server runs as root, bubblewrap starts the interpreter as root in those namespaces
with every capability dropped but CAP_SETUID and CAP_SETGID, which `python_sandbox.py` uses once, before
the grader's code runs, to become `uid` (an unprivileged id of its own, not the server's): that clears
its capabilities, and no_new_privs (set by bubblewrap's seccomp load) keeps any exec from granting new
ones. Otherwise, as an unprivileged server, bubblewrap adds a user namespace (`--unshare-user`,
`--disable-userns`) where the grader is uid 65534 with no capability. Either way the seccomp filter
(`seccomp_filter.py`) is loaded before the interpreter starts.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
INSTALL = "apt-get install bubblewrap"
UNPRIVILEGED_UID = 65534
ENV = {"HOME": "/tmp", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the python grader sandbox (the message names what to install)."""


@dataclass(frozen=True, slots=True)
class SandboxHost:
    """What the sandbox is built from on this machine: bubblewrap, the interpreter and its prefix."""

    bwrap: str
    python: str  # the interpreter's real path (a virtual environment's python resolved to its base)
    prefix: str  # the interpreter's installation (its standard library), bound read-only

    @staticmethod
    def find() -> SandboxHost:
        """This machine's; SandboxUnavailable names the package when `bwrap` is missing."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable("python graders run in a bubblewrap sandbox, and `bwrap` is not on PATH: "
                                     f"install it with `{INSTALL}` (Debian/Ubuntu's `bubblewrap` package)")
        python, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
        if not (_under(python, prefix) or _under(python, "/usr")):
            raise SandboxUnavailable(f"the interpreter {python} lies outside its prefix {prefix} and /usr: the "
                                     "python grader sandbox binds only those")
        return SandboxHost(bwrap, python, prefix)

    def exposed(self) -> tuple[str, ...]:
        """The host folders the sandbox shows (read-only)."""
        return ("/usr",) if _under(self.prefix, "/usr") else ("/usr", self.prefix)


def _under(path: str, folder: str) -> bool:
    return Path(path).is_relative_to(folder)


def _system() -> list[str]:
    """`/usr` and the top-level links or folders of the system's libraries and programs."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in SYSTEM_LINKS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def _prefix(prefix: str) -> list[str]:
    """The interpreter's prefix at its own path (its library's run path is absolute), its parents
    created world-readable (bubblewrap makes them 0700 otherwise, which an unprivileged uid cannot cross)."""
    if _under(prefix, "/usr"):
        return []
    args: list[str] = []
    for parent in reversed(Path(prefix).parents[:-1]):
        args += ["--perms", "0755", "--dir", str(parent)]
    return args + ["--ro-bind", prefix, prefix]


def bwrap_argv(host: SandboxHost, *, seccomp_fd: int, tmpfs_bytes: int, privileged: bool,
               command: list[str]) -> list[str]:
    """bubblewrap's arguments to run `command` (the interpreter's arguments) in the sandbox (module
    docstring); `privileged`: the server runs as root (the child then drops to its own uid itself)."""
    who = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if privileged else \
        ["--unshare-user", "--disable-userns", "--uid", str(UNPRIVILEGED_UID), "--gid", str(UNPRIVILEGED_UID),
         "--cap-drop", "ALL"]
    env = [arg for name, value in ENV.items() for arg in ("--setenv", name, value)]
    return [host.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            *who, "--die-with-parent", "--new-session", "--hostname", "grader",
            *_system(), *_prefix(host.prefix), "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--size", str(tmpfs_bytes), "--tmpfs", "/tmp", "--remount-ro", "/",
            "--chdir", "/tmp", "--clearenv", *env, "--seccomp", str(seccomp_fd), "--", host.python, *command]
