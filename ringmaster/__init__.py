"""Runtime helpers shared by the daemons and the CLI: logging and the NATS connection."""
