"""Secrets read from files: the job's token and etcd's USER:PASSWORD. A file that other users can read is refused,
and nothing read here is ever logged."""

from __future__ import annotations

import os
import shlex
import stat

from tfelastic.daemon.errors import ConfigError

MAX_TOKEN_CHARS = 1024  # far below gRPC's metadata limit (16 KiB); `openssl rand -hex 32` writes 64
SECRET_FILE_BYTES = 4 * MAX_TOKEN_CHARS  # what is read of a secret file, its whitespace included
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_token(path: str, option: str = "--token-file") -> str:
    """The shared secret: one word of printable ASCII, in a file that only its owner can read."""
    return read_secret(path, option, words=True)


def read_secret(path: str, option: str, *, words: bool) -> str:
    """A secret from a file. Refuses what is not a regular file, a file of another user (root's aside), one that
    other users can read, an empty one and an oversized one; with ``words``, anything but one word of printable
    ASCII (what travels as gRPC metadata). Checked before it is read, and read bounded."""
    data, info = read_named_file(path, option, SECRET_FILE_BYTES, "the secret", too_big=(
        f"more than the {MAX_TOKEN_CHARS} characters a token may have (it travels in the metadata of every call); "
        f"e.g. openssl rand -hex 32 > {shlex.quote(path)}"))
    _check_secret_owner_and_mode(path, option, info)
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{option}: {path!r} is not text; write a printable secret, e.g. "
                          f"openssl rand -hex 32 > {shlex.quote(path)}") from None
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


def read_named_file(path: str, option: str, limit: int, holds: str, *,
                    too_big: str = "") -> tuple[bytes, os.stat_result]:
    """The contents of a file a setting names, and what fstat says of it: opened without blocking (a FIFO would
    hang the open), refused unless it is a regular file, and refused past ``limit`` bytes before more is read
    (``/dev/zero`` would fill the memory). ``holds``: what the file should hold; ``too_big``: the refusal's words
    after "holds N bytes, " for a file past the limit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path!r}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        kind = next((name for test, name in _KINDS if test(info.st_mode)), None)
        if kind is not None or not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{option}: {path!r} is {kind or 'not a regular file'}; name the regular file that "
                              f"holds {holds}")
        data = b"" if info.st_size > limit else _read_at_most(fd, limit + 1)  # it may grow meanwhile
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path!r}: {e.strerror}") from None
    finally:
        os.close(fd)
    size = max(info.st_size, len(data))
    if size > limit:
        raise ConfigError(f"{option}: {path!r} holds {size} bytes, "
                          + (too_big or f"more than the {limit} that {holds} may take; name the file that holds "
                                        f"{holds}"))
    return data, info


def _read_at_most(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _check_secret_owner_and_mode(path: str, option: str, info: os.stat_result) -> None:
    """Its owner is this process's user (or root); nobody else may read it. chmod is advised only for a file of
    this user's own group: a file that others need to read as it is (``/etc/shadow``) is not a secret file."""
    uid = os.geteuid()
    if info.st_uid not in (uid, 0):
        raise ConfigError(f"{option}: {path!r} belongs to uid {info.st_uid}, not to this process's user (uid {uid}) "
                          "or root; the secret file must be the service user's own")
    if not info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return
    mode = f"mode {stat.S_IMODE(info.st_mode):o}"
    if info.st_uid == uid and info.st_gid == os.getegid():
        raise ConfigError(f"{option}: {path!r} is readable by other users ({mode}); run: chmod 600 "
                          f"{shlex.quote(path)}")
    raise ConfigError(f"{option}: {path!r} is readable by other users ({mode}, group {info.st_gid}): not a file "
                      "for a secret; put the secret in a file of its own that only you can read, e.g. "
                      "openssl rand -hex 32 > FILE; chmod 600 FILE")
