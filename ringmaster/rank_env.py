"""The environment a node agent gives each rank it starts, beside torchrun's own (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``):
the names, in one place, for the agent that sets them (``nodeagent.supervisor``) and the
rank that reads them (``ringmaster.rank.launch`` and the modules it names). A typo on either side
is then an import error, not a variable silently unset.
"""

from __future__ import annotations

JOB_ID = "RINGMASTER_JOB_ID"  # the job; also how a rank's process is recognised as one
JOB_SPEC = "RINGMASTER_JOB_SPEC"  # the JSON JobSpec the agent wrote; beat and exit record beside it
WORKDIR = "RINGMASTER_WORKDIR"  # relative paths in the spec resolve against it
CONTROL_SOCKET = "RINGMASTER_CONTROL_SOCKET"  # the agent's Unix socket; rank 0 connects
ATTEMPT = "RINGMASTER_ATTEMPT"  # the job attempt this rank was launched for (1, 2, …)
NODE = "RINGMASTER_NODE"  # the agent's node id
SIMULATED = "RINGMASTER_SIMULATED"  # "1" on a simulated node: rehearsal knobs honoured
SIM_KNOBS = "RINGMASTER_SIM_KNOBS"  # on simulated nodes only: the knobs file ranks read
COMPILE_CACHE = "RINGMASTER_COMPILE_CACHE"  # node-local compiled-code cache (a default)
