"""Prometheus metrics of the agent and the coordinator. Every collector takes a registry: no global state."""
