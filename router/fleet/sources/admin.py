"""The admin API as a source of membership: add, replace, drain and remove backends at run time.

Off unless the config lists ``admin_keys`` (bearer keys distinct from the clients' ``api_keys``; a
client key gets 403, no key 401, and with no admin key configured the endpoints answer 404):

- ``GET /admin/backends``: the membership, each backend with its state, origin and health;
- ``PUT /admin/backends/NAME``: body = the fields of a ``[[backends]]`` table (``url``, ``kv_events``,
  ``kv_replay``, ``dp_size``, ``models``, ``role``, ...; the name comes from the path): adds the
  backend (201) or brings an existing one in line with it (200); decoded straight into the table's
  typed fields and validated like the config file (400 naming the offending field in ``error.param``:
  a wrong type, an unknown key, nesting where a string belongs, a control character);
- ``DELETE /admin/backends/NAME``: drains it, then removes it once its requests finished;
- ``POST /admin/backends/NAME/drain``: drains it and keeps it (a PUT readmits it).

Each answers with the resulting entry. What the admin API changes is running state, not the file: a
config reload re-applies the file, so a backend the file lists comes back as the file says (even
after an admin DELETE), while backends only the admin API added stay across reloads. With
``server.workers > 1`` every change is appended to a journal in the supervisor's run directory and
every worker applies it (a worker that restarts replays the journal), so all workers see the same
membership within one tick (~50 ms). The journal also records each config reload a worker applied
(``reload``: a changed file applied whole, identified by the version read; ``restore``: an
operator's reload of an unchanged file, with the names it brought back). Running workers skip
those (each reloads the file itself); a restarted worker's replay re-applies them in their place,
with the file as it is now, so an admin change that a later reload overrode stays overridden there
too. Every worker records the reloads it applied: a file version's reload is replayed once, where
its first record stands (a worker that read the file a tick later than another may have synced an
admin change in between, and the others applied that change after the reload); a restore brings
back only the names it brought back then (a name a discovered pod took meanwhile stays the pod's).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from router.config import BackendConfig, ConfigError, decode_backend
from router.errors import ApiError, bad_request, forbidden, not_found, unauthorized
from router.fleet.load import LoadTracker
from router.fleet.membership import Member, Membership

log = logging.getLogger("kvrouter.admin")


class _Op(msgspec.Struct, omit_defaults=True):
    op: str  # put | delete | drain | reload | restore
    name: str  # (a reload: the version of the file it read, ConfigWatcher.version; a restore: "")
    origin: str  # "worker:pid" that made the change (it applied it already)
    spec: BackendConfig | None = None
    names: list[str] | None = None  # a restore: the names it brought back


class AdminJournal:
    """Admin changes shared between worker processes: an append-only file of JSON lines."""

    def __init__(self, path: str | Path, me: str) -> None:
        self.path = Path(path)
        self.me = me
        self._offset = 0
        self._buffer = b""

    def append(self, op: _Op) -> None:
        """Record a change (one ``write`` under an exclusive lock: lines never interleave)."""
        line = msgspec.json.encode(op) + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line)
        finally:
            os.close(fd)

    def read_new(self) -> list[_Op]:
        """Changes appended since the last call (all of them the first time), others' only."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._buffer + data
        lines = data.split(b"\n")
        self._buffer = lines.pop()  # an incomplete last line waits for the rest
        out = []
        for line in lines:
            if not line:
                continue
            try:
                op = msgspec.json.decode(line, type=_Op)
            except msgspec.DecodeError:
                log.error("admin journal: unreadable line skipped")
                continue
            if op.origin != self.me:
                out.append(op)
        return out


class AdminApi:
    """The admin endpoints' logic (the HTTP routes in router.app call these)."""

    def __init__(
        self,
        membership: Membership,
        loads: LoadTracker,
        workers: int = 1,
        journal: AdminJournal | None = None,
        file_backends: Callable[[], list[BackendConfig]] | None = None,
    ) -> None:
        """``file_backends``: the backends the config file lists now (what a replayed reload
        applies); None: the router runs without a config file, and no reload is replayed."""
        self.membership = membership
        self.loads = loads
        self.workers = workers
        self.journal = journal
        self.file_backends = file_backends
        self._replayed = False
        self._reloads_seen: set[str] = set()  # the replay's file versions, each replayed once

    def _entry(self, m: Member) -> dict[str, Any]:
        return m.describe(self.loads.local_active(m.targets))

    def list(self) -> dict[str, Any]:
        """GET /admin/backends."""
        return {
            "backends": [self._entry(m) for m in list(self.membership.members.values())],
            "counts": self.membership.counts(),
            "worker": self.journal.me if self.journal is not None else None,
        }

    def put(self, name: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """PUT /admin/backends/NAME: (201 created | 200 updated, entry)."""
        try:
            spec = decode_backend(body, name, self.workers)
        except ConfigError as exc:
            raise bad_request(str(exc), "invalid_backend", exc.field) from None
        member, created = self.membership.upsert(spec, "admin", "PUT /admin/backends")
        self._share(_Op("put", name, "", spec))
        return (201 if created else 200), self._entry(member)

    def delete(self, name: str) -> dict[str, Any]:
        """DELETE /admin/backends/NAME: drain, then remove."""
        member = self.membership.drain(name, remove=True, reason="DELETE /admin/backends")
        if member is None:
            raise not_found(f"no backend named `{name}`", "backend_not_found")
        self._share(_Op("delete", name, ""))
        return self._entry(member)

    def drain(self, name: str) -> dict[str, Any]:
        """POST /admin/backends/NAME/drain: drain and keep."""
        member = self.membership.drain(name, remove=False, reason="POST /admin/backends/NAME/drain")
        if member is None:
            raise not_found(f"no backend named `{name}`", "backend_not_found")
        self._share(_Op("drain", name, ""))
        return self._entry(member)

    def reloaded(self, version: str) -> None:
        """A changed config file this worker applied (``version``: ConfigWatcher.version, what it
        read), recorded for the replay of a worker started later."""
        self._share(_Op("reload", version, ""))

    def restored(self, names: Sequence[str]) -> None:
        """The backends an unchanged config file's reload brought back here, recorded likewise."""
        self._share(_Op("restore", "", "", names=[*names]))

    def _share(self, op: _Op) -> None:
        if self.journal is not None:
            op.origin = self.journal.me
            try:
                self.journal.append(op)
            except OSError as exc:  # the change holds here; the other workers will not see it
                log.error("admin journal: cannot record %s %s: %s", op.op, op.name, exc)

    def sync(self) -> None:
        """Apply the other workers' changes (called on every membership tick)."""
        if self.journal is None:
            return
        replay, self._replayed = not self._replayed, True  # the first read: what came before us
        for op in self.journal.read_new():
            if op.op in ("reload", "restore"):
                if replay and self.file_backends is not None:
                    self._replay_reload(op)
                continue  # (a running worker applied that reload itself)
            if op.op == "put" and op.spec is not None:
                self.membership.upsert(op.spec, "admin", "PUT /admin/backends (another worker)")
            elif op.op == "delete":
                self.membership.drain(op.name, remove=True, reason="DELETE /admin/backends (another worker)")
            elif op.op == "drain":
                self.membership.drain(op.name, remove=False, reason="drain (another worker)")

    def _replay_reload(self, op: _Op) -> None:
        """A reload recorded before this worker started, applied in its place in the journal: the
        file as it is now (the only version there is to read), with that reload's rule."""
        assert self.file_backends is not None
        backends = self.file_backends()
        if op.op == "reload":
            if op.name in self._reloads_seen:
                return  # (another worker's record of a reload replayed already)
            if op.name:  # (a record of an older version names none: each is replayed)
                self._reloads_seen.add(op.name)
            self.membership.reconcile("config", backends, "config file reloaded (journal replay)")
            return
        # (a record of an older version lists no names: it restored whatever the file lists)
        names = None if op.names is None else set(op.names)
        back = [b for b in backends if names is None or b.name in names]
        self.membership.restore(back, "config", "restored by a config file reload (journal replay)")


def compare_digest(a: bytes, b: bytes) -> bool:
    """hmac.compare_digest (constant time), hmac imported at the first key compared: it loads
    OpenSSL's hashes, ~1 ms of every start, keys or not."""
    # optional: OpenSSL's hmac only when a key is checked (~ms of a start)
    import hmac

    return hmac.compare_digest(a, b)


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The key of the first ``Authorization: Bearer`` header, or b"" without one."""
    for key, value in headers:
        if key == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip()
    return b""


def admin_auth(headers: Any, admin_keys: list[bytes], client_keys: list[bytes]) -> None:
    """404 when the admin API is off, 401 without a valid admin key, 403 for a client key."""
    if not admin_keys:
        raise not_found("the admin API is off (no admin_keys configured)")
    token = bearer_token(headers)
    if token and any(compare_digest(token, k) for k in admin_keys):
        return
    if token and any(compare_digest(token, k) for k in client_keys):
        raise forbidden("this key is a client key; the admin API needs an admin key")
    raise unauthorized()


__all__ = ["AdminApi", "AdminJournal", "ApiError", "admin_auth", "bearer_token"]
