"""Secrets read from files: the job's token and etcd's USER:PASSWORD. A file that other users can read is refused,
and nothing read here is ever logged."""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path

from tfelastic.daemon.errors import ConfigError

MAX_TOKEN_CHARS = 1024  # far below gRPC's metadata limit (16 KiB); `openssl rand -hex 32` writes 64


def read_token(path: str, option: str = "--token-file") -> str:
    """The shared secret: one word of printable ASCII, in a file that only its owner can read."""
    return read_secret(path, option, words=True)


def read_secret(path: str, option: str, *, words: bool) -> str:
    """A secret from a file. Refuses a file that other users can read, an empty one and an oversized one; with
    ``words``, anything but one word of printable ASCII (what travels as gRPC metadata)."""
    try:
        info = os.stat(path)
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{option}: {path!r} is not text; write a printable secret, e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{option}: {path!r} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                          f"run: chmod 600 {shlex.quote(path)}")
    if not secret:
        raise ConfigError(f"{option}: {path!r} is empty; put a random secret in it, e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}")
    if len(secret) > MAX_TOKEN_CHARS:
        raise ConfigError(f"{option}: {path!r} holds {len(secret)} characters, more than the {MAX_TOKEN_CHARS} a "
                          "token may have (it travels in the metadata of every call); e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}")
    if words and (not (secret.isascii() and secret.isprintable()) or any(c.isspace() for c in secret)):
        raise ConfigError(f"{option}: {path!r} must hold one word of printable ASCII (it travels as gRPC "
                          f"metadata), e.g. openssl rand -hex 32 > {shlex.quote(path)}")
    return secret
