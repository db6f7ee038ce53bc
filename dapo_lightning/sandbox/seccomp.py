"""A seccomp filter for the sandboxed code (bwrap installs it with ``--seccomp FD`` just before
the code's interpreter starts): the system calls that would let the code build namespaces of
its own, mount file systems, or reach the kernel's larger attack surfaces fail.

Without it the code could create a user namespace of its own (an unprivileged user may), become
"root" there and mount a tmpfs of any size, outside every limit of the sandbox. With it, on
x86-64:

* ``unshare``, ``setns``, ``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new mount
  API (``open_tree``, ``move_mount``, ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``,
  ``mount_setattr``), ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_setup``,
  ``ptrace`` and the key calls (``add_key``, ``request_key``, ``keyctl``) fail with EPERM;
* ``clone`` with any namespace flag fails with EPERM (plain forks and threads pass);
* ``clone3``, whose flags a filter cannot read, fails with ENOSYS: the C library then falls
  back to ``clone``;
* the x32 system call numbers fail with EPERM, and a call made with another architecture's
  convention (32-bit ``int 0x80``) kills the process.

Elsewhere (not x86-64) :func:`seccomp_program` is None and the sandbox runs without the filter.
"""

from __future__ import annotations

import errno
import platform
import struct

#: The x86-64 system calls that fail with EPERM (name -> number).
BLOCKED_X86_64 = {
    "ptrace": 101, "pivot_root": 155, "chroot": 161, "mount": 165, "umount2": 166,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "setns": 308, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442,
}  # fmt: skip
CLONE, CLONE3 = 56, 435
#: ``CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET``.
NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
NAMESPACE_FLAGS |= 0x40000000
AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000

_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000


def _assemble(program: list[tuple[int, str | None, str | None, int] | str]) -> bytes:
    """``struct sock_filter`` bytes of ``program``: instructions ``(code, jump-if-true label,
    jump-if-false label, k)`` (None: the next instruction) and label strings marking the
    instruction after them."""
    where: dict[str, int] = {}
    steps = []
    for item in program:
        if isinstance(item, str):
            where[item] = len(steps)
        else:
            steps.append(item)
    out = b""
    for i, (code, yes, no, k) in enumerate(steps):
        jt = where[yes] - i - 1 if yes else 0
        jf = where[no] - i - 1 if no else 0
        out += struct.pack("<HBBI", code, jt, jf, k)
    return out


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The classic-BPF seccomp filter of the module docstring for ``machine`` (default this
    one's), as bwrap's ``--seccomp`` reads it; None where it has none (not x86-64)."""
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return None
    program: list[tuple[int, str | None, str | None, int] | str] = [
        (_LD_ABS, None, None, 4),  # seccomp_data.arch
        (_JEQ, "native", "kill", AUDIT_ARCH_X86_64),
        "native",
        (_LD_ABS, None, None, 0),  # seccomp_data.nr
        (_JGE, "deny", None, X32_BIT),
        (_JEQ, "enosys", None, CLONE3),
        (_JEQ, "clone", None, CLONE),
        *[(_JEQ, "deny", None, nr) for nr in sorted(BLOCKED_X86_64.values())],
        (_RET, None, None, _ALLOW),
        "clone",
        (_LD_ABS, None, None, 16),  # seccomp_data.args[0], low 32 bits: the clone flags
        (_JSET, "deny", None, NAMESPACE_FLAGS),
        (_RET, None, None, _ALLOW),
        "deny",
        (_RET, None, None, _ERRNO | errno.EPERM),
        "enosys",
        (_RET, None, None, _ERRNO | errno.ENOSYS),
        "kill",
        (_RET, None, None, _KILL_PROCESS),
    ]
    return _assemble(program)
