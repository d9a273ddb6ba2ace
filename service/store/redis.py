"""The Redis cursor store: every job in two hashes, every operation one Lua script.

Each mutating operation is one Lua script (run with EVALSHA, reloaded after a
Redis restart flushed the script cache), so check-and-set is atomic for any
number of servers on any hosts; the trade-off is that the typed refusals are
raised here, in Python, from what the script read (Lua cannot raise them), so
the scripts return status codes, never errors.

Layout, under a namespace (``ladle`` by default) with the job name as a Redis
Cluster hash tag so that all of a job's keys share one slot:

* ``ladle:{run-42}:job``: a hash of ``format`` (``FORMAT_VERSION``, the
  version of this layout), ``dataset_fingerprint``, ``config_fingerprint``,
  ``world_size``, ``created``, ``updated``, ``incarnation`` and ``plan``
  (``base.plan_to_json``);
* ``ladle:{run-42}:ranks``: a hash with one field per rank (``"3"``) holding
  ``"epoch,step,generation,last_seen"``.

A job hash without ``format`` is version 1 (written before the field
existed) and is read and written as it is. A job of a newer format (a newer
ladle wrote it) raises ``StoreFormatError`` and is neither read nor written:
every script that changes a job checks its format first. Keys that do not
follow this layout (a hand edit, another tool, a ``format`` that is not a
version) raise ``StoreCorruptError`` naming the key and field. Both are for
that job only: listings leave such a job out, with one warning.

Integers travel as decimal strings and are compared in Lua as doubles, exact
up to ``MAX_INDEX`` (2**53 - 1); times are written as Python's ``repr`` of the
float and read back bit for bit. Every successful write refreshes a TTL of
``job_ttl_s`` on both keys, so a job nobody touches for that long disappears
(``0`` keeps jobs forever). Durability is Redis's: run it with
``appendonly yes`` (``deploy/redis.conf``); a Redis that lost recent writes
is detected and reconciled by the jobs layer (``FencedError`` with a
generation above the stored one, a lost job's ``incarnation``).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final, NoReturn
from urllib.parse import quote, unquote, unquote_plus, urlsplit

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import (
    ConfigError,
    JobNotFoundError,
    StoreCorruptError,
    StoreCredentialsError,
    StoreError,
    StoreFormatError,
    StoreUnavailableError,
    WorldSizeMismatchError,
)
from . import DEFAULT_JOB_TTL_S
from .base import (
    Clock,
    CursorStore,
    JobSpec,
    JobState,
    Position,
    RankState,
    Resize,
    check_forward,
    check_generation,
    check_identity,
    check_job_ttl,
    plan_from_json,
    plan_to_json,
    rank_outside,
    shown_value,
)

__all__ = ["FORMAT_VERSION", "RedisCursorStore", "redact_url", "redis_client"]

log = logging.getLogger("ladle.store")

_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,100}")

# The version of the layout above, stored in each job hash as ``format``. Raise it when a change
# would make an older ladle misread a job: that ladle then refuses the job rather than guess.
FORMAT_VERSION: Final = 1

# --- the scripts ---------------------------------------------------------------
# KEYS[1] is the job hash, KEYS[2] the ranks hash. Every script returns a table
# whose first element is a status; the last ARGV of each writer is the TTL in
# milliseconds (0: persist). Numbers leave Lua as strings (string.format('%d')
# is exact to 2**53; tostring is not). Every script that changes a job first
# returns {'format', format} for a job whose format this ladle does not write
# (_Record.version says which error, and mirrors `ours`).

_LUA_HELPERS: Final = (
    f"local FORMAT_VERSION = '{FORMAT_VERSION}'\n"
    + """
local function ours(format)
  if not format then return true end  -- false from HGET, nil from fields(): version 1
  if not string.match(format, '^%d+$') then return false end
  local version = tonumber(format)
  return version >= 1 and version <= tonumber(FORMAT_VERSION)
end
local function parse(v)
  return string.match(v, '^(%d+),(%d+),(%d+),(.+)$')
end
local function touch(ttl)
  if tonumber(ttl) > 0 then
    redis.call('PEXPIRE', KEYS[1], ttl)
    redis.call('PEXPIRE', KEYS[2], ttl)
  else
    redis.call('PERSIST', KEYS[1])
    redis.call('PERSIST', KEYS[2])
  end
end
local function fill(world_size, value)
  local args = {}
  for r = 0, world_size - 1 do
    args[#args + 1] = string.format('%d', r)
    args[#args + 1] = value
    if #args >= 2000 then
      redis.call('HSET', KEYS[2], unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('HSET', KEYS[2], unpack(args)) end
end
local function fields(flat)
  local map = {}
  for i = 1, #flat, 2 do map[flat[i]] = flat[i + 1] end
  return map
end
"""
)

# ARGV: reset, dataset_fingerprint, config_fingerprint, world_size, now, incarnation, plan, ttl
_OPEN: Final = (
    _LUA_HELPERS
    + """
if ARGV[1] == '1' then redis.call('DEL', KEYS[1], KEYS[2]) end
local job = redis.call('HGETALL', KEYS[1])
if #job > 0 then
  local f = fields(job)
  if not ours(f.format) then return {'format', f.format} end
  if f.dataset_fingerprint == ARGV[2] and f.config_fingerprint == ARGV[3] and f.world_size == ARGV[4] then
    touch(ARGV[8])
  end
  return {'exists', job, redis.call('HGETALL', KEYS[2])}
end
redis.call('HSET', KEYS[1], 'format', FORMAT_VERSION, 'dataset_fingerprint', ARGV[2],
  'config_fingerprint', ARGV[3], 'world_size', ARGV[4], 'created', ARGV[5], 'updated', ARGV[5],
  'incarnation', ARGV[6], 'plan', ARGV[7])
fill(tonumber(ARGV[4]), '0,0,0,' .. ARGV[5])
touch(ARGV[8])
return {'created'}
"""
)

# ARGV: rank, world_size, now, ttl
_JOIN: Final = (
    _LUA_HELPERS
    + """
local format = redis.call('HGET', KEYS[1], 'format')
if not ours(format) then return {'format', format} end
local world_size = redis.call('HGET', KEYS[1], 'world_size')
if not world_size then return {'missing'} end
if world_size ~= ARGV[2] then return {'world_size', world_size} end
local value = redis.call('HGET', KEYS[2], ARGV[1])
if not value then return {'rank', world_size} end
local epoch, step, generation = parse(value)
generation = string.format('%d', tonumber(generation) + 1)
redis.call('HSET', KEYS[2], ARGV[1], epoch .. ',' .. step .. ',' .. generation .. ',' .. ARGV[3])
redis.call('HSET', KEYS[1], 'updated', ARGV[3])
touch(ARGV[4])
return {'ok', epoch, step, generation}
"""
)

# ARGV: rank, generation, epoch, step, now, mode (advance | rewind | reconcile), ttl
_MOVE: Final = (
    _LUA_HELPERS
    + """
local format = redis.call('HGET', KEYS[1], 'format')
if not ours(format) then return {'format', format} end
local world_size = redis.call('HGET', KEYS[1], 'world_size')
if not world_size then return {'missing'} end
local value = redis.call('HGET', KEYS[2], ARGV[1])
if not value then return {'rank', world_size} end
local epoch, step, current = parse(value)
local given, stored = tonumber(ARGV[2]), tonumber(current)
if stored ~= given and not (ARGV[6] == 'reconcile' and stored < given) then
  return {'fenced', current}
end
if ARGV[6] == 'advance' then
  local to_epoch, to_step = tonumber(ARGV[3]), tonumber(ARGV[4])
  local at_epoch, at_step = tonumber(epoch), tonumber(step)
  if to_epoch < at_epoch or (to_epoch == at_epoch and to_step < at_step) then
    return {'regression', epoch, step}
  end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. ',' .. ARGV[4] .. ',' .. ARGV[2] .. ',' .. ARGV[5])
redis.call('HSET', KEYS[1], 'updated', ARGV[5])
touch(ARGV[7])
return {'ok'}
"""
)

# ARGV: from_world_size, to_world_size, cut entry JSON ('' = the stored cursors), its start epoch, now, ttl
_RESIZE: Final = (
    _LUA_HELPERS
    + """
local job = redis.call('HGETALL', KEYS[1])
if #job == 0 then return {'missing'} end
local f = fields(job)
if not ours(f.format) then return {'format', f.format} end
if f.world_size == ARGV[2] then
  touch(ARGV[6])
  return {'same', job, redis.call('HGETALL', KEYS[2])}
end
if f.world_size ~= ARGV[1] then return {'world_size', f.world_size} end
local ranks = fields(redis.call('HGETALL', KEYS[2]))
local top, cut, start = 0, {}, nil
for r = 0, tonumber(ARGV[1]) - 1 do
  local epoch, step, generation = parse(ranks[string.format('%d', r)])
  if tonumber(generation) > top then top = tonumber(generation) end
  cut[#cut + 1] = '[' .. epoch .. ',' .. step .. ']'
  if start == nil or tonumber(epoch) < tonumber(start) then start = epoch end
end
local entry = ARGV[3]
if entry == '' then
  entry = '[' .. ARGV[1] .. ',[' .. table.concat(cut, ',') .. ']]'
else
  start = ARGV[4]
end
local plan = f.plan
if plan == '[]' then plan = '[' .. entry .. ']' else plan = string.sub(plan, 1, -2) .. ',' .. entry .. ']' end
local generation = string.format('%d', top + 1)
redis.call('DEL', KEYS[2])
fill(tonumber(ARGV[2]), start .. ',0,' .. generation .. ',' .. ARGV[5])
redis.call('HSET', KEYS[1], 'world_size', ARGV[2], 'plan', plan, 'updated', ARGV[5])
touch(ARGV[6])
return {'ok', job, plan, generation, start}
"""
)

_GET: Final = """
local job = redis.call('HGETALL', KEYS[1])
if #job == 0 then return false end
return {job, redis.call('HGETALL', KEYS[2])}
"""

_DELETE: Final = """
local existed = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
return existed
"""


# What to tell an operator whose URL's userinfo does not parse. The command reads the password from
# its input, so that it appears on no command line.
PERCENT_ENCODE_HINT: Final = (
    "percent-encode reserved characters in the password: / as %2F, # as %23, ? as %3F, % as %25, "
    "@ as %40 (and : in a user name as %3A), e.g. with "
    "python3 -c 'import urllib.parse; print(urllib.parse.quote(input(), safe=\"\"))'"
)


def _misread_userinfo(url: str) -> tuple[str, str, str] | None:
    """``(head, userinfo, tail)`` of a URL whose userinfo ``urlsplit`` would not read as one; else None.

    ``urlsplit`` ends the authority at the first ``/``, ``?`` or ``#`` after
    ``://``: one written unencoded in a password cuts the userinfo short, and
    the rest of the password lands in the port, path or query. Such a URL (or
    one ``urlsplit`` refuses, or one without ``://``) holding an ``@`` is
    taken as ``head`` (the scheme and ``://``), ``userinfo`` (everything up
    to the last ``@``) and ``tail`` (the host and what follows it).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, tail = rest.rpartition("@")
    if not at:
        return None
    authority = re.match(r"[^/?#]*", rest)
    if sep and authority is not None and len(authority.group()) > len(userinfo):
        try:
            urlsplit(url)
            return None  # the last @ lies inside the authority: a userinfo urlsplit reads
        except ValueError:
            pass  # brackets in the userinfo read as an IPv6 address
    return scheme + sep, userinfo, tail


def redact_url(url: str) -> str:
    """``url`` with every password in it replaced by ``***``.

    That is the userinfo's password and the value of every query parameter
    whose name contains ``password`` (``password=``, ``ssl_password=``, in any
    case or %-encoding): redis-py hands unknown query keys to the connection,
    so any of them may carry a secret. A userinfo that does not parse (an
    unencoded ``/``, ``?`` or ``#`` in the password) is replaced whole:
    everything between ``://`` and the last ``@``.
    """
    misread = _misread_userinfo(url)
    if misread is not None:
        head, _, tail = misread
        host, mark, query = tail.partition("?")
        return f"{head}***@{host}{mark}{_redact_query(query)}"
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        if ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:***@{hostinfo}"
    query = _redact_query(parts.query)
    # Rebuilt by hand: urlunsplit drops the empty authority of unix:///path.
    text = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else url
    if query:
        text += f"?{query}"
    return text + (f"#{parts.fragment}" if parts.fragment else "")


def _redact_query(query: str) -> str:
    return "&".join(_redact_parameter(p) for p in query.split("&")) if query else ""


def _redact_parameter(parameter: str) -> str:
    """One ``name=value`` of a query; its value is ``***`` if the decoded name holds ``password``."""
    name, sep, _ = parameter.partition("=")
    return f"{name}=***" if sep and "password" in unquote_plus(name).lower() else parameter


def _url_secrets(url: str) -> tuple[str, ...]:
    """Every text of ``url`` that an error echoing it must not show, longest first.

    The password as written and as decoded, the first query parameter whose
    name holds ``password`` (as ``redact_url`` hides it), and for a userinfo
    that does not parse, the whole of it and each piece between reserved
    characters (a parse error quotes such a piece: "as 'Kq3'").
    """
    secrets: set[str] = set()
    misread = _misread_userinfo(url)
    if misread is not None:
        userinfo = misread[1]
        password = userinfo.partition(":")[2] or userinfo  # the user name is no secret
        secrets.update((userinfo, unquote(userinfo), password))
        secrets.update(piece for piece in re.split(r"[:/?#@\[\]]", password) if len(piece) >= 3)
    else:
        try:
            parts = urlsplit(url)
        except ValueError:
            return ()
        if parts.password:
            secrets.update((parts.password, unquote(parts.password)))
        # the first query parameter whose name holds "password" (password=, ssl_password=)
        match = re.search(r"(?i)(?:^|&)[^&=]*password[^&=]*=([^&]*)", parts.query)
        if match and match.group(1):
            secrets.update((match.group(1), unquote(match.group(1))))
    return tuple(sorted((s for s in secrets if s), key=len, reverse=True))


def _url_password(url: str) -> str | None:
    """The password ``url`` gives redis-py, as written (not decoded): the userinfo's, else ``password=``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.password:
        return parts.password
    match = re.search(r"(?i)(?:^|&)password=([^&]*)", parts.query)
    return match.group(1) if match and match.group(1) else None


def redis_client(
    url: str, *, socket_timeout_s: float = 5.0, max_connections: int | None = None
) -> redis.Redis:
    """The redis-py client a ``RedisCursorStore`` uses for ``url`` (no connection is made yet).

    Strings are decoded; connecting and every reply wait at most
    ``socket_timeout_s``; a failed command is never retried (a script that
    reached Redis before the connection broke must not run twice). RESP2, the
    protocol every Redis (and compatible server) speaks, unless the URL asks
    for ``?protocol=3``: the scripts return only arrays and strings. Query
    options of the URL (``?ssl_cert_reqs=none``, ``?db=``...) are redis-py's.
    ``ValueError`` for a URL redis-py cannot parse.
    """
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
        protocol=2,
        max_connections=max_connections,
        client_name="ladle",
    )


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000)) if seconds > 0 else 0


# --- reading a job's hashes --------------------------------------------------------
# What Redis holds is whatever was written there: another ladle version, another tool, a hand
# edit, a half-restored backup. Every read of a field names the key and field it could not read
# (StoreCorruptError), never a KeyError from deep inside.


def _fields(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _unreadable(exc: rex.ResponseError) -> bool:
    """Whether a script failed on what it read (a key of another type, a value it cannot parse), not on
    Redis: ladle's scripts raise no error of their own."""
    message = str(exc)
    lua_failure = "attempt to" in message or "bad argument" in message  # Lua's own runtime errors
    return message.startswith("WRONGTYPE") or ("user_script" in message and lua_failure)


class _Record:
    """One job's two hashes, as read by a script: ``keys`` are ``[job key, ranks key]``."""

    def __init__(
        self, job: str, keys: list[str], job_flat: list[str], ranks_flat: list[str] | None = None
    ) -> None:
        self.job = job
        self.keys = keys
        self.fields = _fields(job_flat)
        self.ranks_flat = ranks_flat or []

    def corrupt(self, field: str, detail: str, *, key: int = 0) -> StoreCorruptError:
        return StoreCorruptError(self.job, self.keys[key], field, detail)

    def version(self) -> int:
        """The job's format version: 1 if it has none (an earlier ladle wrote it).

        ``StoreFormatError`` for a version above ``FORMAT_VERSION``,
        ``StoreCorruptError`` for a value that is no version (the scripts'
        ``ours`` refuses exactly these two).
        """
        value = self.fields.get("format")
        if value is None:
            return 1
        try:
            version = int(value) if value.isascii() and value.isdigit() else 0
        except ValueError:  # more digits than int() reads: no version either
            version = 0
        if version < 1:
            raise self.corrupt("format", f"holds format={shown_value(value)}, not a format version")
        if version > FORMAT_VERSION:
            raise StoreFormatError(self.job, self.keys[0], version, FORMAT_VERSION)
        return version

    def text(self, field: str) -> str:
        value = self.fields.get(field)
        if value is None:
            raise self.corrupt(field, f"lacks the field {field}")
        return value

    def integer(self, field: str) -> int:
        value = self.text(field)
        try:
            return int(value)
        except ValueError:
            raise self.corrupt(field, f"holds {field}={shown_value(value)}, not an integer") from None

    def real(self, field: str) -> float:
        value = self.text(field)
        try:
            return float(value)
        except ValueError:
            raise self.corrupt(field, f"holds {field}={shown_value(value)}, not a number") from None

    def spec(self, world_size: int | None = None) -> JobSpec:
        size = self.integer("world_size") if world_size is None else world_size
        try:
            return JobSpec(self.job, self.text("dataset_fingerprint"), self.text("config_fingerprint"), size)
        except ConfigError as exc:
            raise self.corrupt(exc.field, f"holds an invalid {exc}") from None

    def plan(self, text: str | None = None) -> tuple[Resize, ...]:
        text = self.text("plan") if text is None else text
        try:
            return plan_from_json(text)
        except (ValueError, TypeError):  # not JSON, or not a list of [world_size, [[epoch, step]...]]
            raise self.corrupt("plan", f"holds plan={shown_value(text)}, not a resize history") from None

    def ranks(self, world_size: int) -> tuple[RankState, ...]:
        stored = _fields(self.ranks_flat)
        names = [str(rank) for rank in range(world_size)]
        wanted = set(names)
        if len(stored) != world_size or not stored.keys() >= wanted:
            missing = sorted(wanted - stored.keys(), key=int)
            others = sorted(stored.keys() - wanted)
            what = f"lacks rank(s) {', '.join(missing[:5])}" if missing else f"holds fields {others[:5]}"
            raise self.corrupt("ranks", f"{what}, for world_size {world_size}", key=1)
        seen: dict[tuple[str, str], Position] = {}  # a thousand ranks stand at a few positions
        return tuple([self._rank(rank, stored[name], seen) for rank, name in enumerate(names)])

    def _rank(self, rank: int, value: str, seen: dict[tuple[str, str], Position]) -> RankState:
        try:
            epoch, step, generation, last_seen = value.split(",")
            position = seen.get((epoch, step))
            if position is None:
                position = seen[epoch, step] = Position(int(epoch), int(step))
            return RankState(rank, position, int(generation), float(last_seen))
        except ValueError:
            detail = f"holds rank {rank} as {shown_value(value)}, not epoch,step,generation,last_seen"
            raise self.corrupt(str(rank), detail, key=1) from None

    def state(self) -> JobState:
        self.version()  # first: a newer format may lay out the other fields differently
        spec = self.spec()
        return JobState(
            spec,
            self.ranks(spec.world_size),
            self.real("created"),
            self.real("updated"),
            self.text("incarnation"),
            self.plan(),
        )


class RedisCursorStore(CursorStore):
    """A ``CursorStore`` in Redis, shared by any number of threads, processes and hosts.

    ``url`` is ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS)
    or ``unix:///path/to.sock?db=N``; redis-py parses it and uses hiredis when
    it is installed. The constructor pings Redis, so a wrong password or an
    unreachable server fails at start-up with ``StoreUnavailableError``
    within ``socket_timeout_s`` (and a replica with ``StoreError``); later,
    a Redis that is down makes each call
    fail the same way (after at most one connect attempt, never a retry
    loop: a script that reached Redis before the connection broke must not
    run twice). Messages and ``repr`` name the URL with its password
    redacted.

    One connection pool per store object, safe for threads; a forked child
    reconnects (redis-py replaces a pool inherited through fork) and a
    pickled store reopens from its URL and options.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = time.time,
        namespace: str = "ladle",
        job_ttl_s: float = DEFAULT_JOB_TTL_S,
        socket_timeout_s: float = 5.0,
        max_connections: int | None = None,
        read_only: bool = False,
    ) -> None:
        super().__init__(clock=clock)
        self.read_only = read_only
        if not isinstance(url, str) or not url:
            raise ConfigError("redis_url", f"must be a redis://, rediss:// or unix:// URL, got {url!r}")
        if not isinstance(namespace, str) or _NAMESPACE.fullmatch(namespace) is None:
            raise ConfigError(
                "namespace", f"must be 1..100 characters of A-Z a-z 0-9 . _ -, got {namespace!r}"
            )
        if not isinstance(socket_timeout_s, int | float) or not socket_timeout_s > 0:
            raise ConfigError("socket_timeout_s", f"must be > 0, got {socket_timeout_s!r}")
        self._url = url
        self.url = redact_url(url)
        self._secrets = _url_secrets(url)
        self._password = _url_password(url)
        self.namespace = namespace
        self.job_ttl_s = check_job_ttl(job_ttl_s)
        self.socket_timeout_s = float(socket_timeout_s)
        self.max_connections = max_connections
        self._ttl = str(_ms(self.job_ttl_s))
        self._closed = False
        self._close_lock = threading.Lock()
        if "://" in url and _misread_userinfo(url) is not None:
            # redis-py would read part of the password as the port, path or query (and its message
            # would quote it), or connect elsewhere: say what is wrong, in words of our own
            raise ConfigError(
                "redis_url",
                f"{self.url}: cannot be read: an @ lies past the end of the host part, as when the "
                "password holds an unencoded /, ?, # or [ ] (an @ in a query value or a socket path: "
                f"write it as %40); {PERCENT_ENCODE_HINT}",
            )
        try:
            self._redis = redis_client(
                url, socket_timeout_s=self.socket_timeout_s, max_connections=max_connections
            )
        except (ValueError, TypeError) as exc:
            hint = f"; {PERCENT_ENCODE_HINT}" if "@" in url else ""
            raise ConfigError("redis_url", f"{self.url}: {self._scrub(str(exc))}{hint}") from None
        self._open_script = self._redis.register_script(_OPEN)
        self._join_script = self._redis.register_script(_JOIN)
        self._move_script = self._redis.register_script(_MOVE)
        self._resize_script = self._redis.register_script(_RESIZE)
        self._get_script = self._redis.register_script(_GET)
        self._delete_script = self._redis.register_script(_DELETE)
        try:
            if read_only:  # a listing (ladle jobs): any replica will do, and nothing is written
                with self._client() as client:
                    client.ping()
            else:
                self._check_server()  # first: a replica is named as one, not as a refused write
                self._ping()  # a write: a Redis that refuses them is not started on
        except BaseException:
            self.close()
            raise

    def _check_server(self) -> None:
        """At start-up: the scripts run (a user without EVALSHA failed every trainer later, each
        after its whole timeout), the server is not a replica (it passed start-up and readiness, then
        refused every write), and a Redis that evicts keys or keeps nothing on disk is named in a
        warning. ROLE and CONFIG are often refused (ACLs, managed Redis): those checks are skipped."""
        with self._client() as client:
            self._get_script(keys=self._keys("ladle-start-up-check"), client=client)  # loads and runs
            role = self._role(client)
            config = {name: self._config(client, name) for name in ("maxmemory-policy", "appendonly", "save")}
        if role in ("slave", "replica"):
            raise StoreError(
                f"cursor store {self.url} is a replica (ROLE {role}): it refuses every write; point "
                "LADLE_REDIS_URL / --redis-url at the primary"
            )
        policy = config["maxmemory-policy"]
        if policy and policy != "noeviction":
            log.warning(
                "cursor store %s: Redis evicts keys under memory pressure (maxmemory-policy %s), so it "
                "can drop a job's cursors; set maxmemory-policy noeviction (deploy/redis.conf)",
                self.url,
                policy,
            )
        if config["appendonly"] == "no" and config["save"] == "":
            log.warning(
                'cursor store %s: Redis keeps nothing on disk (appendonly no, save ""), so a restart '
                "of Redis forgets every job; the trainers that are running put their cursors back, a "
                "trainer down at that moment must resume from its checkpoint (docs/state.md); set "
                "appendonly yes (deploy/redis.conf)",
                self.url,
            )

    def _role(self, client: redis.Redis) -> str:
        """The server's replication role (``master``, ``slave``...), or "" if it will not say."""
        try:
            return str(client.role()[0])
        except rex.ResponseError as exc:  # refused by an ACL, or renamed: INFO may still say
            log.debug("cursor store %s: ROLE refused (%s)", self.url, self._scrub(str(exc)))
        try:
            return str(client.info("replication").get("role", ""))
        except rex.ResponseError as exc:
            log.debug("cursor store %s: INFO replication refused (%s)", self.url, self._scrub(str(exc)))
            return ""

    def _config(self, client: redis.Redis, name: str) -> str | None:
        """One setting of the server, or None if CONFIG GET is refused (ACLs, renamed, managed Redis)."""
        try:
            value = client.config_get(name).get(name)
        except rex.ResponseError as exc:
            log.debug("cursor store %s: CONFIG GET %s refused (%s)", self.url, name, self._scrub(str(exc)))
            return None
        return None if value is None else str(value)

    def __repr__(self) -> str:
        return f"RedisCursorStore({self.url!r}, namespace={self.namespace!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # A store crosses to another process as its URL and options; the child connects afresh.
        return (
            _reopen,
            (
                self._url,
                self._clock,
                self.namespace,
                self.job_ttl_s,
                self.socket_timeout_s,
                self.max_connections,
            ),
        )

    # --- keys, calls and errors ----------------------------------------------

    def _keys(self, job: str) -> list[str]:
        prefix = f"{self.namespace}:{{{job}}}:"
        return [prefix + "job", prefix + "ranks"]

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***").replace(quote(secret, safe=""), "***")
        return text

    def _unavailable(self, exc: rex.RedisError) -> StoreError:
        """The ladle error for a redis-py error: ``StoreUnavailableError`` unless Redis rejected a script."""
        message = self._scrub(str(exc))
        first = message.split(" ", 1)[0]
        if isinstance(exc, rex.AuthenticationWrongNumberOfArgsError) or "without any password configured" in (
            message
        ):
            return StoreCredentialsError(
                f"cursor store {self.url}: the URL gives a password but this Redis has none configured "
                "(no requirepass); remove it from the URL or configure it on the server"
            )
        if self._password is None and (first == "NOAUTH" or "Authentication required" in message):
            return StoreCredentialsError(
                f"cursor store {self.url}: the URL gives no password but Redis requires one ({message}); "
                f"give it as redis://:PASSWORD@host:port/db; {PERCENT_ENCODE_HINT}"
            )
        if isinstance(exc, rex.AuthenticationError) or first in ("WRONGPASS", "NOAUTH"):
            decoded = ""
            if self._password is not None and unquote(self._password) != self._password:
                decoded = (
                    "; the URL's password holds %-sequences, which are decoded (%2F is /): a % that is "
                    "part of the password itself must be written %25"
                )
            return StoreCredentialsError(
                f"cursor store {self.url}: Redis refused the password ({message}); "
                f"check the password in the Redis URL{decoded}"
            )
        if isinstance(exc, rex.NoPermissionError) or first == "NOPERM":
            # not transient: a trainer that retried it waited out its whole timeout for nothing
            return StoreError(
                f"cursor store {self.url}: the Redis user lacks a permission ladle needs ({message}); "
                "it runs Lua scripts (EVALSHA, SCRIPT LOAD) on its own keys (ladle:*)"
            )
        if isinstance(exc, rex.ReadOnlyError) or first == "READONLY":
            return StoreUnavailableError(
                f"cursor store {self.url} refuses writes: it is a read-only replica ({message}); "
                "point LADLE_REDIS_URL / --redis-url at the primary"
            )
        if isinstance(exc, rex.ConnectionError | rex.TimeoutError):
            return StoreUnavailableError(
                f"cursor store {self.url} cannot be reached: {message}{self._tls_hint(exc)}"
            )
        if isinstance(exc, rex.OutOfMemoryError) or first in (
            "OOM",
            "MISCONF",
            "BUSY",
            "MASTERDOWN",
            "LOADING",
            "TRYAGAIN",
            "CLUSTERDOWN",
        ):
            return StoreUnavailableError(f"cursor store {self.url} cannot take this operation now: {message}")
        if isinstance(exc, rex.InvalidResponse) or message.startswith("Protocol error"):
            return StoreError(
                f"cursor store {self.url}: what answers there does not speak Redis ({message}); "
                "is that a Redis server's host and port?"
            )
        return StoreError(f"cursor store {self.url}: Redis refused an operation: {message}")

    def _tls_hint(self, exc: rex.RedisError) -> str:
        """A hint when a failure to connect looks like TLS on one side only (redis:// vs rediss://)."""
        message = str(exc).lower()
        if self._url.lower().startswith("rediss://") and (
            isinstance(exc, rex.TimeoutError) or "ssl" in message or "eof" in message
        ):
            # a plain Redis waits for a command while the client waits for a TLS handshake
            return "; if that port speaks plain Redis (no TLS), use redis:// rather than rediss://"
        if self._url.lower().startswith("redis://") and (
            "reset by peer" in message or "closed by server" in message
        ):
            # a TLS port drops a client that starts with a plain command
            return "; if that port speaks TLS, use rediss:// rather than redis://"
        return ""

    @contextmanager
    def _client(self) -> Iterator[redis.Redis]:
        """The client, with every redis-py error turned into a ladle error (password scrubbed)."""
        if self._closed:
            raise StoreUnavailableError(f"cursor store {self.url} is closed")
        try:
            yield self._redis
        except rex.RedisError as exc:
            raise self._unavailable(exc) from None

    def _record(self, job: str, job_flat: list[str], ranks_flat: list[str] | None = None) -> _Record:
        return _Record(job, self._keys(job), job_flat, ranks_flat)

    def _refuse_format(self, job: str, reply: list[str], what: str) -> NoReturn:
        """Raise the error for a script that found a format it does not write (``reply[1]``)."""
        self._record(job, ["format", reply[1]] if len(reply) > 1 else []).version()
        self._unexpected(what, reply)  # the script and _Record.version disagree

    def _world_size(self, job: str, reply: list[str]) -> int:
        """The stored world size a script returned as ``reply[1]`` (Lua ends a table at a nil: absent)."""
        return self._record(job, ["world_size", reply[1]] if len(reply) > 1 else []).integer("world_size")

    def _run(self, script: Any, job: str, *args: str) -> Any:
        with self._client():
            try:
                return script(keys=self._keys(job), args=args)
            except rex.ResponseError as exc:
                if _unreadable(exc):
                    raise self._corrupt(job, exc) from None
                raise

    def _corrupt(self, job: str, exc: rex.ResponseError) -> StoreCorruptError:
        """The error for a script that failed on what it read from a job's keys."""
        message = self._scrub(str(exc)).split(" script: ", 1)[0]
        job_key, ranks_key = self._keys(job)
        return StoreCorruptError(
            job, job_key, "", f"(or {ranks_key}) holds what ladle's scripts cannot read (Redis: {message})"
        )

    # --- the hooks, one script each --------------------------------------------

    def _open_job(
        self, spec: JobSpec, *, reset: bool, incarnation: str, plan: tuple[Resize, ...]
    ) -> JobState:
        now = self._now()
        reply = self._run(
            self._open_script,
            spec.job,
            "1" if reset else "0",
            spec.dataset_fingerprint,
            spec.config_fingerprint,
            str(spec.world_size),
            repr(now),
            incarnation,
            plan_to_json(plan),
            self._ttl,
        )
        if reply[0] == "format":
            self._refuse_format(spec.job, reply, "open_job")
        if reply[0] == "exists":
            state = self._record(spec.job, reply[1], reply[2]).state()
            check_identity(state.spec, spec)
            return state
        ranks = tuple(RankState(rank, Position(0, 0), 0, now) for rank in range(spec.world_size))
        return JobState(spec, ranks, now, now, incarnation, plan)

    def _resize(
        self, job: str, from_world_size: int, to_world_size: int, cut: tuple[Position, ...] | None
    ) -> JobState:
        now = self._now()
        entry, start = "", ""
        if cut is not None:
            entry = plan_to_json((Resize(from_world_size, cut),))[1:-1]
            start = str(min(p.epoch for p in cut))  # base.resize_start, computed where the cut is known
        reply = self._run(
            self._resize_script,
            job,
            str(from_world_size),
            str(to_world_size),
            entry,
            start,
            repr(now),
            self._ttl,
        )
        status = reply[0]
        if status == "format":
            self._refuse_format(job, reply, "resize")
        if status == "missing":
            raise JobNotFoundError(job)
        if status == "same":
            return self._record(job, reply[1], reply[2]).state()
        if status == "world_size":
            raise WorldSizeMismatchError(job, self._world_size(job, reply), from_world_size)
        record = self._record(job, reply[1])
        plan, generation, at = reply[2], int(reply[3]), Position(int(reply[4]), 0)
        return JobState(
            record.spec(to_world_size),
            tuple(RankState(rank, at, generation, now) for rank in range(to_world_size)),
            record.real("created"),
            now,
            record.text("incarnation"),
            record.plan(plan),
        )

    def _join(self, job: str, rank: int, world_size: int) -> RankState:
        now = self._now()
        reply = self._run(self._join_script, job, str(rank), str(world_size), repr(now), self._ttl)
        status = reply[0]
        if status == "format":
            self._refuse_format(job, reply, "join")
        if status == "missing":
            raise JobNotFoundError(job)
        if status == "world_size":
            raise WorldSizeMismatchError(job, self._world_size(job, reply), world_size)
        if status == "rank":
            raise rank_outside(rank, self._world_size(job, reply))
        return RankState(rank, Position(int(reply[1]), int(reply[2])), int(reply[3]), now)

    def _move(self, job: str, rank: int, generation: int, to: Position, mode: str) -> RankState:
        now = self._now()
        reply = self._run(
            self._move_script,
            job,
            str(rank),
            str(generation),
            str(to.epoch),
            str(to.step),
            repr(now),
            mode,
            self._ttl,
        )
        status = reply[0]
        if status == "format":
            self._refuse_format(job, reply, mode)
        if status == "missing":
            raise JobNotFoundError(job)
        if status == "rank":
            raise rank_outside(rank, self._world_size(job, reply))
        if status == "fenced":
            if len(reply) < 2:  # Lua ends a table at its first nil: the rank's value did not parse
                detail = f"holds rank {rank} in a form that is not epoch,step,generation,last_seen"
                raise self._record(job, []).corrupt(str(rank), detail, key=1)
            check_generation(job, rank, generation, int(reply[1]))
        if status == "regression":
            check_forward(job, rank, Position(int(reply[1]), int(reply[2])), to)
        if status != "ok":
            self._unexpected(mode, reply)
        return RankState(rank, to, generation, now)

    def _unexpected(self, what: str, reply: Any) -> NoReturn:
        raise StoreError(f"cursor store {self.url}: unexpected reply to {what}: {reply!r}")

    def _advance(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        return self._move(job, rank, generation, to, "advance")

    def _rewind(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        return self._move(job, rank, generation, to, "rewind")

    def _reconcile(self, job: str, rank: int, generation: int, to: Position) -> RankState:
        return self._move(job, rank, generation, to, "reconcile")

    def _get(self, job: str) -> JobState:
        reply = self._run(self._get_script, job)
        if reply is None:
            raise JobNotFoundError(job)
        return self._record(job, reply[0], reply[1]).state()

    def _list_jobs(self) -> list[JobState]:
        """Every job of this namespace: SCAN for job keys, then read them all in one MULTI/EXEC.

        The read is one snapshot of the jobs the scan found; a job created
        during the scan may be missing. On a Redis Cluster this client
        (``redis.Redis``) scans only the node it is connected to.
        """
        head, tail = f"{self.namespace}:{{", "}:job"
        with self._client() as client:
            names = sorted(
                {
                    key[len(head) : -len(tail)]
                    for key in client.scan_iter(match=f"{head}*{tail}", count=1000)
                    if key.startswith(head) and key.endswith(tail)
                }
            )
            if not names:
                return []
            pipe = client.pipeline(transaction=True)
            for name in names:
                self._get_script(keys=self._keys(name), client=pipe)
            replies = pipe.execute(raise_on_error=False)
        jobs = []
        for name, reply in zip(names, replies, strict=True):
            try:
                if isinstance(reply, rex.ResponseError) and _unreadable(reply):
                    raise self._corrupt(name, reply)
                if isinstance(reply, rex.RedisError):
                    raise self._unavailable(reply)
                if reply is not None:
                    jobs.append(self._record(name, reply[0], reply[1]).state())
            except StoreCorruptError as exc:
                self._left_out(exc)
        return jobs

    def _delete_job(self, job: str) -> bool:
        return bool(self._run(self._delete_script, job))

    ping_writes = True

    def _ping(self) -> None:
        """A write, not a PING: a Redis that became a replica (a failover), cannot save (MISCONF) or is
        full (OOM) answers PING and refuses every trainer's write. The key is no job's."""
        with self._client() as client:
            client.set(f"{self.namespace}:readiness", "1", px=60_000)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        client: redis.Redis | None = getattr(self, "_redis", None)
        if client is not None:
            client.close()


def _reopen(
    url: str,
    clock: Clock,
    namespace: str,
    job_ttl_s: float,
    socket_timeout_s: float,
    max_connections: int | None,
) -> RedisCursorStore:
    return RedisCursorStore(
        url,
        clock=clock,
        namespace=namespace,
        job_ttl_s=job_ttl_s,
        socket_timeout_s=socket_timeout_s,
        max_connections=max_connections,
    )
