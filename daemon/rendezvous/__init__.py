"""The rendezvous: the coordinator's logic (state), its gRPC adapter (server) and the agent's client."""
