"""Authenticated, encrypted transports between hosts: ZeroMQ's CURVE, checked by ZAP.

`python -m dispatcher keygen DIR` writes a key directory:

    DIR/dispatcher.key, dispatcher.key_secret    the dispatcher's pair
    DIR/NAME.key, NAME.key_secret                each part's pair: `local` (the parts
                                                 `serve` starts itself), `ops` (the ops
                                                 tool), and each --worker / --frontend NAME
    DIR/authorized/workers/NAME.key              the public keys the dispatcher accepts,
    DIR/authorized/frontends/NAME.key            by role (`local` in all three, `ops` in
    DIR/authorized/ops/NAME.key                  ops only)

The dispatcher (`--curve-keys DIR`) serves every socket as a CURVE server and accepts only
the public keys under `authorized/` of the socket's role: workers on the worker and
token-in sockets, front ends on the front-end and token-out sockets (so the token stream
is readable only by them), the ops tool and the front ends on the control socket. A part
(`--curve-keys DIR --curve-name NAME`) needs only `dispatcher.key` and its own
`NAME.key_secret` in DIR: that is what a second host is given. A worker's name is bound
to its key: a key named NAME registers only workers named NAME or NAME-..., `local`
any name no other key holds.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

ROLES = ("workers", "frontends", "ops")
LOCAL, OPS = "local", "ops"


class CurveKeyError(ValueError):
    """A key directory that cannot be used, said in one line."""


RESERVED = ("dispatcher", LOCAL, OPS)     # key names keygen gives itself


def keygen(directory: str, workers: list[str] = (), frontends: list[str] = ()) -> list[str]:
    """Write (or add to) a key directory; returns the names of the pairs written. Every
    name is checked before anything is written; a directory that exists must be a key
    directory (or empty): keygen never takes over another one (it made it 0700)."""
    if not str(directory).strip():
        raise CurveKeyError("give the key directory, e.g. /etc/completions/curve")
    for name in [*workers, *frontends]:
        if not name or "/" in name or name.startswith(".") or name in RESERVED:
            raise CurveKeyError(f"a key name is a plain file name other than "
                                f"{', '.join(RESERVED)}, got {name!r}")
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise CurveKeyError(f"{root} is not a directory")
    # one pair, one role: a worker's pair made a front end's too could read every token;
    # nor is a pair taken back once retired (its public key removed from authorized/: its
    # secret is still where it was)
    for name, role in [*((n, "workers") for n in workers), *((n, "frontends") for n in frontends)]:
        other = "frontends" if role == "workers" else "workers"
        if name in (frontends if role == "workers" else ()) or \
                (root / "authorized" / other / f"{name}.key").exists():
            raise CurveKeyError(f"{name!r} is a {other[:-1]}'s key; a "
                                f"{role[:-1]}'s must be its own: give it another name")
        if (root / f"{name}.key_secret").exists() and \
                not (root / "authorized" / role / f"{name}.key").exists():
            raise CurveKeyError(f"{name!r} names a key pair that is not a {role[:-1]}'s "
                                "(retired, or never one): give the new key another name")
    if root.is_dir() and any(root.iterdir()) and not (root / "dispatcher.key_secret").exists():
        raise CurveKeyError(f"{root} holds other files and no keys: give keygen a new or "
                            "empty directory, or an earlier key directory")
    if not root.is_dir():
        root.mkdir(parents=True)
    if not (root / "dispatcher.key_secret").exists():
        os.chmod(root, 0o700)           # (a new or empty directory: now the keys')
    for role in ROLES:
        (root / "authorized" / role).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "authorized" / role, 0o700)
    os.chmod(root / "authorized", 0o700)
    roles = {"dispatcher": (), LOCAL: ROLES, OPS: ("ops",)}
    roles.update({name: ("workers",) for name in workers})
    roles.update({name: ("frontends",) for name in frontends})
    written = []
    for name, authorized in roles.items():
        if not (root / f"{name}.key_secret").exists():
            zmq.auth.create_certificates(str(root), name)
            os.chmod(root / f"{name}.key_secret", 0o600)
            written.append(name)
        os.chmod(root / f"{name}.key", 0o644)    # (not as the umask says: others may not
        for role in authorized:                  # write a key a part trusts, _private)
            copy = root / "authorized" / role / f"{name}.key"
            shutil.copyfile(root / f"{name}.key", copy)
            os.chmod(copy, 0o644)
    return written


def _private(path: Path, what: str) -> None:
    """A key file or directory only its owner may change (a secret: only read): one
    that others could write lets them authorize their own key or swap a pair."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return                          # (not there: said by the reader, in its words)
    loose = mode & (0o077 if what == "secret" else 0o022)
    if loose:
        raise CurveKeyError(f"{path}: mode {stat.S_IMODE(mode):04o} lets others "
                            f"{'read' if what == 'secret' else 'write'} it; chmod "
                            f"{'go-rwx' if what == 'secret' else 'go-w'} it")


def _secret(path: Path) -> tuple[bytes, bytes]:
    _private(path, "secret")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{path}: not a readable CURVE secret key file ({exc})") from None
    if not secret:
        raise CurveKeyError(f"{path}: holds no secret key")
    return public, secret


def _public(path: Path) -> bytes:
    try:
        return zmq.auth.load_certificate(str(path))[0]
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{path}: not a readable CURVE public key file ({exc})") from None


@dataclass(frozen=True)
class PartKeys:
    """What a part (worker, front end, ops tool) presents to the dispatcher."""
    public: bytes
    secret: bytes
    server: bytes              # the dispatcher's public key

    @classmethod
    def load(cls, directory: str, name: str = LOCAL) -> "PartKeys":
        root = Path(directory)
        public, secret = _secret(root / f"{name}.key_secret")
        _private(root / "dispatcher.key", "key")   # (swapped, a part speaks to another)
        return cls(public, secret, _public(root / "dispatcher.key"))

    def apply(self, sock: zmq.Socket) -> None:
        """Before connect: this socket speaks CURVE to the dispatcher as this part."""
        sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        sock.curve_serverkey = self.server


@dataclass
class DispatcherKeys:
    """The dispatcher's pair and the public keys it accepts, by role."""
    directory: Path
    public: bytes
    secret: bytes
    names: dict[str, str] = field(default_factory=dict)   # z85 public key -> its name
    worker_names: set[str] = field(default_factory=set)   # the names of worker keys

    @classmethod
    def load(cls, directory: str) -> "DispatcherKeys":
        root = Path(directory)
        public, secret = _secret(root / "dispatcher.key_secret")
        keys = cls(root, public, secret)
        _private(root, "directory")
        _private(root / "authorized", "directory")
        for role in ROLES:
            if not (root / "authorized" / role).is_dir():
                raise CurveKeyError(f"{root}: no authorized/{role} directory "
                                "(python -m dispatcher keygen DIR writes one)")
            _private(root / "authorized" / role, "directory")
            for path in (root / "authorized" / role).glob("*.key"):
                _private(path, "key")       # (its directory's mode does not cover it)
                keys.names[_public(path).decode()] = path.stem
                if role == "workers":
                    keys.worker_names.add(path.stem)
        return keys

    def serve(self, sock: zmq.Socket, role: str) -> None:
        """Before bind: this socket is a CURVE server accepting `role`'s keys (ZAP)."""
        sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        sock.curve_server = True
        sock.zap_domain = role.encode()

    def authenticator(self, context: zmq.Context):
        """The ZAP handler of `context`: each role's domain, its authorized keys."""
        from zmq.auth.thread import ThreadAuthenticator
        auth = ThreadAuthenticator(context)
        auth.start()
        for role in ROLES:
            location = str(self.directory / "authorized" / role)
            auth.configure_curve(domain=role, location=location)
        return auth

    def may_register(self, user_id: str | None, identity: str, bound: dict) -> bool:
        """Whether the worker key `user_id` may speak as `identity`: its own name (NAME,
        NAME-...), or for `local` any name; and never a name bound to another key. A
        name is the longest key name it starts with's: key `gpu` may not take
        `gpu-2-cuda0`, which is key `gpu-2`'s (it could lock that host out)."""
        name = self.names.get(user_id or "")
        if name is None:
            return False
        if bound.get(identity, user_id) != user_id:
            return False
        if name == LOCAL:
            return True
        owners = [n for n in self.worker_names if n != LOCAL and (
            identity == n or identity.startswith(n + "-"))]
        return bool(owners) and max(owners, key=len) == name


BOUND_NAMES = 4096      # worker names whose key the dispatcher remembers (bind_name)


def bind_name(bound: dict, identity: str, user_id: str | None) -> None:
    """`identity` speaks with key `user_id` (may_register said it may): the name stays
    that key's, and is now the latest used of `bound`, whose least recently used go past
    BOUND_NAMES (names with a pid in them come and go). Kept in the order first bound,
    a name in use for weeks was the first to go after 4,096 registrations of others,
    and another key could then take it."""
    bound[identity] = bound.pop(identity, user_id)
    while len(bound) > BOUND_NAMES:
        del bound[next(iter(bound))]


LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(address: str) -> bool:
    """Whether a dispatcher address stays on this host (ipc://, or tcp:// to loopback)."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def transport_problem(address: str | None, keys: str | None, insecure: bool,
                      tenants: bool = False) -> str | None:
    """One line when a tcp address would go unauthenticated where that matters: beyond
    loopback always; on loopback too where API keys make tenants (`tenants`: every local
    user reaches a loopback port, and the dispatcher's sockets carry every key's
    prompts and tokens, and take jobs without a key; an ipc directory is this user's
    alone)."""
    if not address or keys or insecure or not address.startswith("tcp://"):
        return None
    if not is_loopback(address):
        return (f"{address} is reachable from other hosts: give --curve-keys DIR (python -m "
                "dispatcher keygen DIR makes one), or --insecure-transport to run it "
                "unauthenticated anyway")
    if tenants:
        return (f"{address} is open to every local user, past the API keys (its sockets "
                "carry every key's prompts and tokens): use an ipc:// address (the "
                "default), or --curve-keys DIR, or --insecure-transport to run it so anyway")
    return None
