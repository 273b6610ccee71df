"""The agent's TOML job file (``tfelastic agent --config JOB.toml``): its sections are the configuration's, its keys
the option table's (:data:`~tfelastic.daemon.options.BY_KEY`), and every problem names the file and the key."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from tfelastic.daemon.config import AgentConfig, from_values, validate
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.options import BY_KEY, OPTIONS
from tfelastic.daemon.secret_file import read_named_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SECTIONS = ("job", "node", "metrics", "rendezvous")
JOB_FILE_BYTES = 4 << 20  # a job file is a few KiB; nothing bigger is one
Completion = Callable[[dict[str, Any]], dict[str, Any]]  # adds values the file left out (daemon/slurm.py)


def load_toml(path: str, complete: Completion | None = None, sources: Mapping[str, str] | None = None) -> AgentConfig:
    """The agent's settings from the job file, ``complete`` adding what comes from elsewhere (named in
    ``sources``: a refusal names a variable that way, the file's keys by the file)."""
    values = read_values(path)
    if "max_nodes" not in values and "min_nodes" in values:
        values["max_nodes"] = values["min_nodes"]  # like --nodes N: a fixed size unless a range is given
    if complete is not None:
        values = complete(values)
    for required in ("command", "rendezvous"):
        if required not in values:
            raise ConfigError(f"{path}: {OPTIONS[required].key} is required")
    return validate(from_values(values), where=path, sources=sources)


def read_values(path: str) -> dict[str, Any]:
    """The file's settings by option name, each of its option's kind."""
    data, _ = read_named_file(path, "--config", JOB_FILE_BYTES, "a job's settings (TOML)")
    try:
        raw = tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config: {path!r} is not valid TOML (UTF-8): {e}") from None
    values: dict[str, Any] = {}
    for section, content in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]; expected one of "
                              f"{', '.join('[' + s + ']' for s in SECTIONS)}")
        if not isinstance(content, dict):
            shape = "an array" if isinstance(content, list) else repr(content)
            raise ConfigError(f"{path}: {section} must be a table ([{section}] with keys under it), not {shape}")
        for key, value in content.items():
            option = BY_KEY.get(f"{section}.{key}")
            if option is None:
                known = sorted(k.partition(".")[2] for k in BY_KEY if k.startswith(section + "."))
                raise ConfigError(f"{path}: unknown key {section}.{key}; expected one of {', '.join(known)}")
            values[option.name] = option.kind.from_toml(value, f"{path}: {option.key}")
    return values
