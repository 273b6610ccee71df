"""tfelastic.daemon: the per-node agent, the coordinator, and the `tfelastic` command."""
