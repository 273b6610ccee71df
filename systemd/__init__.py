"""Makes this folder the package tfelastic.share.systemd, so that a wheel carries the unit, the example job
file and the install script (pyproject.toml's package-dir; tfelastic.daemon.assets finds them)."""
