"""Makes this folder the package tfelastic.share.monitoring, so that a wheel carries the Prometheus rules and
configuration and the Grafana dashboard (pyproject.toml's package-dir; tfelastic.daemon.assets finds them)."""
