"""Ringmaster's wire contract: msgspec structs, subject names and codecs. No I/O here.

The import name ``proto`` is shared with Google's proto-plus package; ``RINGMASTER_PROTO``
lets our other packages check that they imported ours (``ringmaster.guard``).
"""

RINGMASTER_PROTO = True
