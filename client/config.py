"""``ClientConfig``: a ``BatchClient``'s settings, from its arguments and the environment, checked once.

Every argument is checked here, where it enters, so a bad one fails in the
constructor with its name instead of at the first batch; the other parts of
the client take the config as given. The token travels only in the call
metadata: never in a message, a log line or ``repr()``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import socket
from typing import Any

import grpc
import numpy as np

from ladle.proto import codec

from . import _device

__all__ = ["MAX_INDEX", "ClientConfig", "channel_credentials", "grpc_target", "integer", "is_fingerprint"]

log = logging.getLogger("ladle.client")

# The largest epoch or step a position may hold (the cursor store's limit, exact in a double).
MAX_INDEX = 2**53 - 1
_MAX_UINT32 = 2**32 - 1  # world_size and prefetch travel as uint32
_MAX_TIMEOUT = 30 * 86400.0  # "wait for ever" enough for a trainer; gRPC's deadlines overflow far above it
_DEFAULT_PORT = 50051
_URL_SCHEMES = frozenset({"grpc", "grpcs", "http", "https"})
_JOB_NAME = re.compile(codec.JOB_NAME_PATTERN)
# gRPC metadata values are printable ASCII; a client_id is logged by the server
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
_MAX_CLIENT_ID = 256


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


def is_fingerprint(value: Any) -> bool:
    """A string a frame and an Open can carry (encodable, at most MAX_FINGERPRINT_BYTES)."""
    if not isinstance(value, str):
        return False
    try:
        return len(value.encode()) <= codec.MAX_FINGERPRINT_BYTES
    except UnicodeEncodeError:  # a lone surrogate
        return False


def integer(value: Any, name: str, least: int, most: int = MAX_INDEX) -> int:
    """``value`` as an int if it is an integer (numpy's too, not a bool) in least..most, else ValueError."""
    if not is_int(value) or not least <= value <= most:
        too_large = is_int(value) and value > most
        limits = f">= {least}" if most == MAX_INDEX and not too_large else f"in {least}..{most}"
        raise ValueError(f"{name} must be an integer {limits}, got {value!r}")
    return int(value)


def _from_env(value: Any, name: str, default: Any, kind: type) -> Any:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if kind is int:
        if not re.fullmatch(r"[0-9]+", raw.strip()):  # ASCII digits: no "1_0", no other scripts' digits
            raise ValueError(f"environment variable {name}={raw!r} is not a valid int")
        return int(raw)
    return kind(raw)


def grpc_target(address: str) -> str:
    """A gRPC target for ``address``: a host alone gets ladle's port 50051 (gRPC would take 443).

    ``host:port`` and ``[v6]:port`` are kept, as are targets with a scheme
    (``dns:///``, ``unix:``, ``ipv4:``); a malformed one, a port outside
    1..65535, or a URL (``grpc://``, ``http://``: gRPC would resolve the
    whole URL as a host name) is a ValueError at once instead of a timeout
    later.
    """
    scheme, _, rest = address.partition("://")
    if scheme.lower() in _URL_SCHEMES:
        raise ValueError(
            f"server address {address!r} is a URL, not a gRPC target: give host:port "
            f"({rest.rstrip('/') or 'host:port'}), or tls=True for TLS"
        )
    if ":/" in address or address.startswith(("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")):
        return address
    bad = ValueError(f"server address {address!r} is not host:port (port 1..65535)")
    if address.startswith("["):  # [v6] or [v6]:port
        host, close, rest = address[1:].partition("]")
        if not close or not host or (rest and not rest.startswith(":")):
            raise bad
        port = rest[1:] if rest else None
    elif address.count(":") > 1:  # a bare IPv6 address
        host, port = address, None
    else:
        host, colon, port_ = address.partition(":")
        port = port_ if colon else None
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
        if port is None:
            return f"[{host}]:{_DEFAULT_PORT}"
    if not host or (port is not None and not (re.fullmatch(r"[0-9]{1,5}", port) and 1 <= int(port) <= 65535)):
        raise bad
    return address if port is not None else f"{host}:{_DEFAULT_PORT}"


def _token_file() -> str:
    """The first token in the file ``LADLE_TOKEN_FILE`` names (a mounted secret), or ""."""
    path = os.environ.get("LADLE_TOKEN_FILE")
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            return next((line.strip() for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"LADLE_TOKEN_FILE={path!r} cannot be read: {exc}") from None


def _pem(value: bytes | str | os.PathLike[str] | None, env: str, what: str) -> bytes | None:
    """PEM bytes from ``value`` (bytes, PEM text, or a file name) or from the file named by ``env``."""
    if value is None:
        value = os.environ.get(env) or None
        if value is None:
            return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {os.fspath(value)!r}: {exc.strerror or exc}") from None


def channel_credentials(
    tls: bool | None,
    root_certificates: bytes | str | os.PathLike[str] | None,
    client_certificate: bytes | str | os.PathLike[str] | None,
    client_key: bytes | str | os.PathLike[str] | None,
) -> Any:
    """``grpc.ssl_channel_credentials`` when TLS is asked for (explicitly or by certificates), else None."""
    roots = _pem(root_certificates, "LADLE_TLS_CA", "root_certificates")
    cert = _pem(client_certificate, "LADLE_TLS_CERT", "client_certificate")
    key = _pem(client_key, "LADLE_TLS_KEY", "client_key")
    if (cert is None) != (key is None):
        raise ValueError("client_certificate and client_key go together (mutual TLS)")
    if tls is False:
        if roots is not None or cert is not None:
            raise ValueError("tls=False, but TLS certificates were given")
        return None
    if tls is None and roots is None and cert is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)


_warned_default_job = False


def _warn_default_job() -> None:
    """Once a process: two runs that name no job share one, and the second resumes the first."""
    global _warned_default_job
    if not _warned_default_job:
        _warned_default_job = True
        log.warning(
            "BatchClient: no job given (job=... or LADLE_JOB), so the job is 'default'; every run that "
            "names none shares it, and a new run continues where the last one stopped"
        )


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """One client's settings, each checked; make it with ``ClientConfig.from_arguments``.

    ``servers`` are the gRPC targets of ``server`` (``"a:50051,b:50051"``:
    replicas); ``metadata`` carries the token and ``credentials`` the TLS
    settings, both left out of ``repr()``; ``device`` is the resolved torch
    device (None: numpy arrays).
    """

    rank: int
    world_size: int
    server: str
    servers: tuple[str, ...]
    job: str
    prefetch: int
    timeout: float
    client_id: str
    elastic: bool
    own_cursor: bool
    device: Any
    pin_memory: bool | None
    metadata: tuple[tuple[str, str], ...] = dataclasses.field(repr=False)
    credentials: Any = dataclasses.field(repr=False)

    @classmethod
    def from_arguments(
        cls,
        rank: int | None = None,
        world_size: int | None = None,
        server: str | None = None,
        job: str | None = None,
        *,
        prefetch: int = 4,
        device: Any = None,
        timeout: float = 60.0,
        pin_memory: bool | None = None,
        client_id: str | None = None,
        elastic: bool = False,
        own_cursor: bool = False,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        client_certificate: bytes | str | os.PathLike[str] | None = None,
        client_key: bytes | str | os.PathLike[str] | None = None,
    ) -> ClientConfig:
        """``BatchClient``'s arguments checked (else ValueError), defaults from the environment."""
        world_size = integer(_from_env(world_size, "WORLD_SIZE", 1, int), "world_size", 1, _MAX_UINT32)
        rank = integer(_from_env(rank, "RANK", 0, int), "rank", 0)
        if server is not None and not isinstance(server, str):
            raise ValueError(f"server must be a string of host:port, got {server!r}")
        server = str(_from_env(server, "LADLE_SERVER", f"127.0.0.1:{_DEFAULT_PORT}", str))
        named = job
        job = _from_env(job, "LADLE_JOB", "default", str)
        if named is None and not os.environ.get("LADLE_JOB", "").strip():
            _warn_default_job()
        if rank >= world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (world_size={world_size})")
        if not isinstance(job, str) or _JOB_NAME.fullmatch(job) is None:
            raise ValueError(f"job must be {codec.JOB_NAME_RULE}, got {job!r}")
        prefetch = integer(prefetch, "prefetch", 1, _MAX_UINT32)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= _MAX_TIMEOUT
        ):
            raise ValueError(f"timeout must be seconds in (0, {_MAX_TIMEOUT:.0f}], got {timeout!r}")
        if client_id is not None and (
            not isinstance(client_id, str)
            or len(client_id) > _MAX_CLIENT_ID
            or _PRINTABLE_ASCII.fullmatch(client_id) is None
        ):
            raise ValueError(
                f"client_id must be printable ASCII of at most {_MAX_CLIENT_ID} characters, "
                f"got {client_id!r:.100}"
            )
        # rank r starts on the r-th replica (mod n) and fails over in turn
        servers = tuple(grpc_target(a.strip()) for a in server.split(",") if a.strip())
        if not servers:
            raise ValueError(f"server must name at least one host:port, got {server!r}")
        token = str(_from_env(token, "LADLE_TOKEN", "", str)).strip() or _token_file()
        if _PRINTABLE_ASCII.fullmatch(token) is None:  # never echoed: it is a secret
            raise ValueError("the token must be printable ASCII (it travels as gRPC metadata)")
        credentials = channel_credentials(tls, root_certificates, client_certificate, client_key)
        return cls(
            rank=rank,
            world_size=world_size,
            server=server,
            servers=servers,
            job=job,
            prefetch=prefetch,
            timeout=float(timeout),
            client_id=client_id or f"{socket.gethostname()}:{os.getpid()}",
            elastic=bool(elastic),
            own_cursor=bool(own_cursor),
            device=_device.check_device(device, pin_memory),
            pin_memory=pin_memory,
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
            credentials=credentials,
        )
