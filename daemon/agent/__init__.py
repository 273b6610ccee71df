"""The per-node agent."""
