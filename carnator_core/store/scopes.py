"""Scopes: whose work an entry or a calibration profile is, so that no user reaches another's.

A single-user ComfyUI has one scope, "" (every entry written before scopes belongs to it). Under ComfyUI's
`--multi-user`, the scope is the user that queued the prompt (read from the `comfy-user` header as ComfyUI's own
user data reads it, never from anything the client writes into the prompt); a fleet's operator may also set a
namespace, which bounds every scope of its workers. A request sees donors, entries and profiles of its own scope
only: the lookup neither searches nor counts another scope, and the store routes answer for the caller's alone.
"""

from __future__ import annotations

import re

NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
UNKNOWN_USER = "unknown or system user: sampled without reuse, and the store routes answer 403"


class ScopeError(ValueError):
    """A namespace outside the safe set; the deployment must fix its configuration."""


def checked_namespace(namespace: str, source: str) -> str:
    """`namespace` where it is empty or in the safe set (letters, digits, `_`, `.`, `-`; 64 at most, starting with a
    letter or digit), else ScopeError naming where it was set."""
    if namespace and not NAMESPACE.fullmatch(namespace):
        raise ScopeError(f"Carnator namespace {namespace!r} set in {source} is refused: use 1 to 64 letters, digits, "
                         "'_', '.' or '-', starting with a letter or digit")
    return namespace


def scope_for(namespace: str, user: str | None) -> str:
    """The scope of `user` (None: a single-user ComfyUI) under `namespace` ("" where neither is set)."""
    parts = ([namespace] if namespace else []) + ([f"user:{user}"] if user is not None else [])
    return "/".join(parts)
