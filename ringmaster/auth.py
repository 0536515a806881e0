"""Bus credentials as every process reads them: one JSON file per principal, passed by path
(``--creds FILE`` or ``$RINGMASTER_CREDS``) so no secret ever shows on a command line or in
``ps``. The file is written mode 0600; ``coordinator.auth`` generates it together with the
server's ``authorization`` block.

A principal also gets its own reply inbox prefix (``_INBOX.<user>``): the server lets it
subscribe to its own replies only, so one principal cannot read another's answers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

ENV = "RINGMASTER_CREDS"


class Creds(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    user: str
    password: str

    @property
    def inbox(self) -> str:
        return f"_INBOX.{self.user}"


class AuthError(RuntimeError):
    """A one-line reason a process cannot use the bus; CLIs print it and exit 2."""


class CredsError(AuthError):
    """A creds file that cannot be used: it names the file and the problem."""


class Refused(AuthError):
    """The server refused the credentials (or their absence)."""


def load(path: str | Path) -> Creds:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Creds)
    except OSError as exc:
        raise CredsError(f"creds file {path}: {exc.strerror}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CredsError(f"creds file {path}: {exc}") from None


def save(path: Path, creds: Creds) -> None:
    """Write ``path`` readable by its owner only; created 0600, never briefly wider."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.encode(creds))


def from_env(explicit: str | None) -> str | None:
    """The creds path a daemon uses: its flag, else ``$RINGMASTER_CREDS``, else none."""
    return explicit or os.environ.get(ENV) or None


def connect_options(path: str | Path | None) -> dict[str, Any]:
    """``nats.connect`` keyword arguments for the creds in ``path`` (none: no auth)."""
    if path is None:
        return {}
    creds = load(path)
    return {"user": creds.user, "password": creds.password, "inbox_prefix": creds.inbox}


def is_refused(exc: BaseException) -> bool:
    """Whether a connection failed because the server refused the credentials (nats-py
    reports it as a plain error whose text names the violation)."""
    return "authorization" in str(exc).lower() or "authentication" in str(exc).lower()
