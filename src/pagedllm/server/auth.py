"""API keys: the key file, constant-time lookup, reload on SIGHUP.

Key file: one key per line,
`NAME KEY [weight=W] [max_concurrent=C] [tokens_per_minute=T] [admin=yes]`;
blank lines and lines starting with # are ignored. Keys are never logged. An admin key may
also change what the server serves (load and unload LoRA adapters); the others only use it.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import stat
import threading
from dataclasses import dataclass

logger = logging.getLogger("pagedllm.auth")


class KeyFileError(ValueError):
    pass


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str
    weight: float = 1.0
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    admin: bool = False


_OPTIONS = {"weight": float, "max_concurrent": int, "tokens_per_minute": int}
_YES, _NO = ("yes", "true", "1"), ("no", "false", "0")


def parse_key_file(path: str) -> list[ApiKey]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise KeyFileError(f"cannot read API key file {path}: {exc.strerror}") from exc
    keys, names = [], set()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{path}, line {number}"
        if len(parts) < 2:
            raise KeyFileError(f"{where}: expected `NAME KEY [option=value ...]`")
        name, key, options = parts[0], parts[1], {}
        if len(key) < 8:
            raise KeyFileError(f"{where}: the key for {name} is shorter than 8 characters")
        for option in parts[2:]:
            field, _, value = option.partition("=")
            if field == "admin" and value.lower() in _YES + _NO:
                options["admin"] = value.lower() in _YES
                continue
            if field == "admin":
                raise KeyFileError(f"{where}: admin is yes or no, got {value!r}")
            if field not in _OPTIONS or not value:
                raise KeyFileError(f"{where}: unknown option {option.split('=')[0]!r}; "
                                   f"allowed: {', '.join(_OPTIONS)}, admin")
            try:
                options[field] = _OPTIONS[field](value)
            except ValueError as exc:
                raise KeyFileError(f"{where}: {field} must be a number") from exc
            if options[field] <= 0:
                raise KeyFileError(f"{where}: {field} must be positive")
        if name in names:
            raise KeyFileError(f"{where}: the name {name} is used twice")
        names.add(name)
        keys.append(ApiKey(name, key, **options))
    if not keys:
        raise KeyFileError(f"API key file {path} holds no keys")
    return keys


def permission_warning(path: str) -> str | None:
    """Why this key file's permissions are unsafe (other users can read or change it), or None."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    if mode & 0o077 == 0:
        return None
    return (f"the API key file {path} can be read or changed by other users (mode {mode:04o}): "
            f"run `chmod 600 {path}`")


class KeyStore:
    """The current keys; replaced whole on reload, so a reader sees one version or the other."""

    def __init__(self, path: str | None):
        self.path = path
        self._keys: list[ApiKey] = parse_key_file(path) if path else []
        self._lock = threading.Lock()
        # What the last reloads did, for `pagedllm keys` to read back (/health, loopback only).
        self.reloads = 0
        self.reload_error: str | None = None
        self._warn_permissions()

    def _warn_permissions(self) -> None:
        warning = permission_warning(self.path) if self.path else None
        if warning:
            logger.warning("%s", warning)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @property
    def keys(self) -> list[ApiKey]:
        return self._keys

    def lookup(self, presented: str) -> ApiKey | None:
        """Compare against every key in constant time, so timing tells nothing."""
        found = None
        presented_bytes = presented.encode()
        for key in self._keys:
            if hmac.compare_digest(presented_bytes, key.key.encode()):
                found = key
        return found

    def reload_status(self) -> dict:
        """How many reloads this server has done, the last one's error (None: it worked), and
        how many keys it holds."""
        return {"reloads": self.reloads, "error": self.reload_error, "keys": len(self._keys)}

    def reload(self) -> bool:
        """Re-read the file; on error keep the old keys and say why (without any key)."""
        if not self.path:
            return False
        with self._lock:
            try:
                keys = parse_key_file(self.path)
            except KeyFileError as exc:
                logger.error("API keys not reloaded: %s", exc)
                self.reload_error, self.reloads = str(exc), self.reloads + 1
                return False
            self._keys = keys
            self.reload_error, self.reloads = None, self.reloads + 1
        self._warn_permissions()
        logger.info("API keys reloaded: %d key(s): %s", len(keys), ", ".join(k.name for k in keys))
        return True


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
