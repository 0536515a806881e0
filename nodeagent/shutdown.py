"""Whether the host itself is going down, for deciding what a SIGTERM to the agent means.

A reclaimed spot machine's shutdown reaches the agent as SIGTERM, but so does
``systemctl restart ringmaster-nodeagent``: announcing the node gone on every restart would
drain healthy nodes. During a shutdown or reboot systemd reports ``stopping``, and a
scheduled shutdown leaves ``/run/nologin`` or ``/run/systemd/shutdown/scheduled``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def host_shutting_down(run: Path = Path("/run"), systemctl: str = "systemctl") -> bool:
    if (run / "nologin").exists() or (run / "systemd" / "shutdown" / "scheduled").exists():
        return True
    try:
        state = subprocess.run(
            [systemctl, "is-system-running"],
            capture_output=True,
            text=True,
            timeout=1.0,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return state == "stopping"
