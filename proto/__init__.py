"""Ringmaster's wire contract: msgspec structs, subject names and codecs. No I/O here.

The import name ``proto`` is shared with Google's proto-plus package; ``RINGMASTER_PROTO``
lets entry points check that they imported ours (see :func:`ensure_ours`).
"""

RINGMASTER_PROTO = True
WIRE_VERSION = 1


def ensure_ours() -> None:
    """Fail with one clear line if another package named ``proto`` shadows this one."""
    import proto as imported

    if not getattr(imported, "RINGMASTER_PROTO", False):
        where = getattr(imported, "__file__", "?")
        raise SystemExit(
            f"ringmaster: the module 'proto' at {where} is not Ringmaster's "
            "(proto-plus installed in the same environment?); use a separate virtualenv"
        )
