"""``cordon``, ``drain`` and ``undrain``: the operator's node verbs, as ``kubectl
cordon/drain/uncordon`` and ``scontrol update state=drain/resume`` work. The leader
decides (``coordinator.node_keeper``); this asks it, naming who asks, and says what it did
in one line. ``undrain`` also lifts a cordon.

Exit 0 done, 1 refused (an undrain that cannot return a node whose condition is still
open), 2 bad input (no such node, a drain without a reason)."""

from __future__ import annotations

import getpass
import sys

import msgspec

from coordinator.ctl.bus import Session
from coordinator.ctl.errors import CtlError
from proto.api import NodeControl
from ringmaster import auth

DONE = {"cordon": "cordoned", "drain": "drained", "undrain": "returned to service"}


def who(creds: str | None) -> str:
    """Who asks, as recorded with a drain: the creds' NATS user, else the login name,
    else ``operator``."""
    if creds:
        try:
            return auth.load(creds).user
        except auth.CredsError:
            pass  # the session refuses them with its own one line
    try:
        return getpass.getuser() or "operator"
    except (KeyError, OSError):  # no login name for this uid (a container)
        return "operator"


async def node_command(s: Session, action: str, node: str, reason: str, creds: str | None) -> int:
    if action == "drain" and not reason.strip():
        raise CtlError("drain needs a reason: --reason TEXT", code=2)
    fields = {"node": node, "action": action, "reason": reason.strip(), "by": who(creds)}
    req = msgspec.convert(fields, NodeControl)
    reply = await s.ask("node", req)
    if not reply.ok:
        code = 2 if reply.error.startswith(("no node", "drain needs")) else 1
        raise CtlError(reply.error, code=code)
    said = f"{node}: {DONE[action]}"
    if action == "drain":
        said += "; its jobs move elsewhere, checkpoint first where their loops can"
    print(said + (f" ({reply.note})" if reply.note else ""), file=sys.stderr)
    return 0
