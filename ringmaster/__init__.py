"""Runtime shared by the node agent, the coordinator and the CLI, so that neither side has
to import the other: logging, the NATS connection, the clock-probe responder, the agent's
run-directory layout and process helpers."""
