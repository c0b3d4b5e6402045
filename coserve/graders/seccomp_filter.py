"""The seccomp filter of a python grader's sandbox: a compiled BPF program that bubblewrap loads
(`bwrap --seccomp FD`) just before it starts the grader's interpreter, built with libseccomp through its
ctypes binding `pyseccomp` (libseccomp resolves the syscall names, the architecture checks and the BPF
jumps; a hand-written filter would get one of those wrong).

Everything is allowed except what lets a process reach beyond its namespaces or attack the kernel's less
travelled paths, which fail with EPERM: tracing and other processes' memory (`ptrace`,
`process_vm_readv/writev`, `pidfd_getfd`), namespaces (`setns`, `unshare`, `clone` with a namespace flag;
`clone3`, whose flags sit in memory a filter cannot read, is ENOSYS, so the C library falls back to
`clone`), mounts and roots, keyrings, `bpf`, `perf_event_open`, `userfaultfd`, `io_uring`, file handles,
kernel modules and kexec, swap, reboot, the kernel log, clocks, port I/O, and `ioctl(TIOCSTI)` (typing
into a terminal). Another architecture's system calls (32-bit `int 0x80`) kill the process: libseccomp's
default for an architecture the filter was not built for.

`kill`, `tkill` and `tgkill` stay allowed: the sandbox's PID namespace already confines them to the
grader's own processes (its init, bubblewrap, ignores signals sent from inside).
"""

from __future__ import annotations

import errno
import functools
import os

DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "setns", "unshare", "mount",
          "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
          "mount_setattr", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
          "io_uring_setup", "io_uring_enter", "io_uring_register", "open_by_handle_at", "name_to_handle_at",
          "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff",
          "reboot", "syslog", "acct", "iopl", "ioperm", "quotactl", "settimeofday", "clock_settime",
          "clock_adjtime", "adjtimex", "lookup_dcookie", "vhangup")
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
# CLONE_NEWTIME
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                   0x00000080)
TIOCSTI = 0x5412


class SeccompUnavailable(RuntimeError):
    """libseccomp (Debian's `libseccomp2`) or its binding `pyseccomp` is missing."""


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The filter as the BPF program bubblewrap reads (built once per process)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, TypeError, AttributeError) as err:  # TypeError: find_library found nothing
        raise SeccompUnavailable("the python grader sandbox's seccomp filter needs libseccomp: install it with "
                                 f"`apt-get install libseccomp2` and `pip install pyseccomp` ({err})") from None
    denied = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED:
        rules.add_rule(denied, name)
    for flag in NAMESPACE_FLAGS:
        rules.add_rule(denied, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    rules.add_rule(denied, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb") as out:
            rules.export_bpf(out)
        with os.fdopen(read, "rb") as source:
            read = -1
            return source.read()
    finally:
        if read >= 0:
            os.close(read)
