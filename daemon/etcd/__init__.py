"""Coordinator failover on etcd v3: the election of a coordinator among every agent (and head-node coordinators),
and the job's state kept durable in etcd, so that the job survives the loss of any node."""
