"""The import name ``proto`` is shared with Google's proto-plus package. Each of our
packages checks, on import, that ``proto`` is ours, and stops with one clear line if not
(a SystemExit raised during import prints its message, no traceback)."""

from __future__ import annotations


def check_proto() -> None:
    import proto

    if not getattr(proto, "RINGMASTER_PROTO", False):
        where = getattr(proto, "__file__", None) or "?"
        raise SystemExit(
            f"ringmaster: the 'proto' package at {where} is not Ringmaster's wire contract "
            "(is proto-plus installed here?); install Ringmaster in its own virtualenv"
        )
