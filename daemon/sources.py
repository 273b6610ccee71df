"""Where a command's settings come from, in order of precedence: its flags, then ``TFELASTIC_<OPTION>`` environment
variables, then the job file (``--config JOB.toml``, or ``$TFELASTIC_CONFIG``), then (agents in a SLURM job step)
SLURM's environment, then the built-in defaults. Every command reads the same job file: an operator command or a
standalone coordinator takes from it only the settings it has (the rendezvous, the token, TLS, etcd, the job's
name), so one file per job serves them all.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from tfelastic.daemon.config import parse_nodes
from tfelastic.daemon.config_file import read_values
from tfelastic.daemon.errors import ConfigError
from tfelastic.daemon.options import OPTIONS, NodeRange, Rendezvous, Switch, parse_rendezvous

CONFIG_ENV = "TFELASTIC_CONFIG"
LISTEN_ENV = "TFELASTIC_LISTEN"  # a standalone coordinator's --listen, which is no job setting
PREFIX = "TFELASTIC_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(option: str) -> str:
    """``TFELASTIC_TOKEN_FILE`` for ``token_file``; the node range is ``TFELASTIC_NODES`` (MIN[:MAX])."""
    return PREFIX + ("NODES" if option in ("min_nodes", "max_nodes") else option.upper())


def config_variables() -> frozenset[str]:
    """Every variable a setting can come from (the agent keeps them from its trainer's environment)."""
    return frozenset({CONFIG_ENV, LISTEN_ENV, *(env_name(name) for name in OPTIONS)})


def environment_values(environ: Mapping[str, str], names: Iterable[str]) -> dict[str, Any]:
    """The settings among ``names`` that ``TFELASTIC_*`` variables give, parsed as their flags would be."""
    values: dict[str, Any] = {}
    for name in names:
        variable = env_name(name)
        text = environ.get(variable)
        if text is None or name == "max_nodes" or not OPTIONS[name].flag:  # the file's alone: the command, env
            continue
        values.update(_parse(name, variable, text))
    return values


def _parse(name: str, variable: str, text: str) -> dict[str, Any]:
    kind = OPTIONS[name].kind
    if isinstance(kind, NodeRange):
        low, high = parse_nodes(text, variable)
        return {"min_nodes": low, "max_nodes": high}
    if isinstance(kind, Rendezvous):
        return {name: parse_rendezvous(text, variable)}
    if isinstance(kind, Switch):
        lowered = text.lower()
        if lowered not in _TRUE + _FALSE:
            raise ConfigError(f"{variable}: {text!r} is neither true nor false (1/0, on/off, yes/no)")
        return {name: lowered in _TRUE}
    parser = kind.flag_type()
    try:
        return {name: parser(text)}
    except argparse.ArgumentTypeError as e:  # the option's own parser: its message names the value
        raise ConfigError(f"{variable}: {e}") from None
    except ValueError:
        what = "a whole number" if parser is int else "a number" if parser is float else "a valid value"
        raise ConfigError(f"{variable}: {text!r} is not {what}") from None


def file_values(path: str | None, names: Iterable[str]) -> dict[str, Any]:
    """The job file's settings among ``names`` (the others are another command's)."""
    if not path:
        return {}
    wanted = set(names)
    values = read_values(path)
    if "min_nodes" in values and "max_nodes" not in values:
        values["max_nodes"] = values["min_nodes"]  # like --nodes N: a fixed size unless a range is given
    return {name: value for name, value in values.items() if name in wanted}


class Gathered(NamedTuple):
    """A command's settings by option name, and where each came from that was no flag (``TFELASTIC_JOIN_TIMEOUT``,
    ``job.toml: rendezvous.join_timeout``), so that a refusal names the setting the user wrote."""

    values: dict[str, Any]
    sources: dict[str, str]


def gather(flags: dict[str, Any], names: Iterable[str], environ: Mapping[str, str],
           config: str | None) -> Gathered:
    """The settings among ``names`` from every source, the flags' first."""
    wanted = list(names)
    path = config or environ.get(CONFIG_ENV)
    in_file, in_environment = file_values(path, wanted), environment_values(environ, wanted)
    sources = {name: f"{path}: {OPTIONS[name].key}" for name in in_file}
    sources |= {name: env_name(name) for name in in_environment}
    for name in flags:
        sources.pop(name, None)
    return Gathered({**in_file, **in_environment, **flags}, sources)
