"""Run inside a node or coordinator container by ``systemd-run``: tries what each of the
units' system-call restrictions forbids, each in a child process of its own, and prints
one JSON object: the operation → whether it succeeded. Run once under the unit's
sandbox and once without it, the two answers tell which restrictions systemd enforces
here and which this container forbids anyway (those cannot be checked here)."""

import ctypes
import json
import mmap
import os
import socket
from pathlib import Path

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER = 0x10000000
ADDR_NO_RANDOMIZE = 0x0040000
PTRACE_TRACEME = 0
AF_ALG = 38


def unshare_user() -> bool:
    return libc.unshare(CLONE_NEWUSER) == 0


def realtime() -> bool:
    class Param(ctypes.Structure):
        _fields_ = [("priority", ctypes.c_int)]

    return libc.sched_setscheduler(0, 1, ctypes.byref(Param(1))) == 0  # SCHED_FIFO


def setuid_bit() -> bool:
    path = Path(f"/tmp/probe-{os.getpid()}")
    path.touch()
    try:
        path.chmod(0o4755)
        return bool(path.stat().st_mode & 0o4000)
    finally:
        path.unlink()


def personality() -> bool:
    return libc.personality(ADDR_NO_RANDOMIZE) != -1


def write_execute() -> bool:
    prot = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
    mmap.mmap(-1, 4096, prot=prot).close()
    return True


def family(number: int, kind: int) -> bool:
    socket.socket(number, kind).close()
    return True


def ptrace() -> bool:
    return libc.ptrace(PTRACE_TRACEME, 0, None, None) == 0


OPERATIONS = {
    "unshare_user": unshare_user,
    "realtime": realtime,
    "setuid_bit": setuid_bit,
    "personality": personality,
    "write_execute": write_execute,
    "af_alg": lambda: family(AF_ALG, socket.SOCK_SEQPACKET),
    "af_netlink": lambda: family(socket.AF_NETLINK, socket.SOCK_RAW),
    "ptrace": ptrace,
}


def attempt(operation: str) -> bool:
    pid = os.fork()
    if pid == 0:
        try:
            ok = OPERATIONS[operation]()
        except OSError:
            ok = False
        os._exit(0 if ok else 1)
    return os.waitpid(pid, 0)[1] == 0


print(json.dumps({name: attempt(name) for name in OPERATIONS}))
