"""Where an archive lives: opening a location (a path, a URL and its storage options, a zip
file, any zarr store), the object I/O the archive does itself, and the one-writer lock.

Object I/O goes through zarr's store calls (its synchronous ones where the store has them:
no round trip through zarr's event loop), with zarr's coalesced, concurrency-limited ranged
reads on object stores. Two pieces on a local directory are the archive's own, kept by
measurement (`benchmarks/README.md`): writing an object (a temporary file renamed over it,
as zarr's local store does, but from the parts of a shard without first joining them into
one buffer, which cost 0.68x the write rate of uncompressed data; and flushed to disk first
with `fsync=True`, which zarr does not do), and ranged reads of a shard (one open file read
at each offset, where zarr's reads cost 0.71 to 0.81x the rate of random windows). Every
object is replaced atomically either way.
"""

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import itertools
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zarr
import zarr.storage
from zarr.abc.store import RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync


LOCK_KEY = "_writer_lock/zarr.json"
LOCK_ATTR = "equibuffer_lock"
_THREADS = max(4, 2 * (os.cpu_count() or 1))


class ArchiveLockedError(RuntimeError):
    """Raised when a second writer opens an archive that a writer already holds.

    !!! example

        ```python
        import equibuffer as eb, jax.numpy as jnp, tempfile

        buffer = eb.ItemBuffer({"x": jnp.float32(0)}, add_batch_size=1, capacity=4)
        path = tempfile.mkdtemp() + "/run.zarr"
        with eb.Archive(path, buffer):
            try:
                eb.Archive(path, buffer)  # a second writer
                locked = False
            except eb.ArchiveLockedError:
                locked = True
            assert locked
            assert len(eb.Archive(path, mode="r")) == 0  # readers are always welcome
        ```
    """


# ----------------------------------------------------------------------- storage options

# The settings of an S3 store that both obstore and fsspec (s3fs) take, in obstore's spelling
# (the one documented) and s3fs's. obstore's own aliases of them are accepted as obstore
# accepts them (upper case, an `aws_` prefix).
_S3_FSSPEC = {
    "access_key_id": "key",
    "secret_access_key": "secret",
    "session_token": "token",
    "endpoint": "endpoint_url",
    "skip_signature": "anon",
    "request_payer": "requester_pays",
    "region": "region_name",  # inside s3fs's `client_kwargs`
}
_S3_ALIASES = {
    **{k: k for k in _S3_FSSPEC},
    **{"aws_" + k: k for k in _S3_FSSPEC},
    **{v: k for k, v in _S3_FSSPEC.items()},
    "token": "session_token",
    "aws_token": "session_token",
    "aws_endpoint_url": "endpoint",
    "aws_default_region": "region",
    "default_region": "region",
}
# obstore's S3 settings that fsspec has no spelling for here.
_S3_OBSTORE_ONLY = {
    "aws_endpoint_url_s3",
    "bucket",
    "checksum_algorithm",
    "conditional_put",
    "container_credentials_relative_uri",
    "container_credentials_full_uri",
    "container_authorization_token_file",
    "copy_if_not_exists",
    "disable_tagging",
    "disable_bulk_delete",
    "metadata_endpoint",
    "role_arn",
    "role_session_name",
    "server_side_encryption",
    "sse_bucket_key_enabled",
    "sse_kms_key_id",
    "sts_endpoint",
    "unsigned_payload",
    "virtual_hosted_style_request",
    "web_identity_token_file",
    "credential_provider",
    "retry_config",
}
_OBSTORE_S3_DOCS = "https://developmentseed.org/obstore/latest/api/store/aws/"


def s3_options(options: dict[str, Any], backend: str) -> dict[str, Any]:
    """`storage_options` of an `s3://` URL, in obstore's spelling or s3fs's, as `backend`
    (`"obstore"` or `"fsspec"`) takes them: the same settings reach the same store either
    way, and a setting one backend has no spelling for is an error that says what to do."""
    where = "Archive(): storage_options"
    canonical: dict[str, Any] = {}
    rest: dict[str, Any] = {}

    def put(key: str, value: Any, given: str) -> None:
        if key in canonical:
            raise ValueError(f"{where}: {given!r} sets {key!r} a second time; pass it once.")
        canonical[key] = value

    for given, value in options.items():
        if given == "client_kwargs":  # s3fs's botocore client arguments
            for k, v in dict(value).items():
                if k in ("region_name", "endpoint_url"):
                    put(_S3_ALIASES[k], v, f"client_kwargs[{k!r}]")
                elif backend == "fsspec":
                    rest.setdefault("client_kwargs", {})[k] = v
                else:
                    raise ValueError(
                        f"{where}: client_kwargs[{k!r}] is s3fs's; obstore (which opens s3:// "
                        f"URLs when installed) takes its settings as in {_OBSTORE_S3_DOCS}."
                    )
        elif given == "client_options":  # obstore's HTTP client options
            options_ = dict(value)
            if backend == "obstore":
                rest["client_options"] = options_
                continue
            options_.pop("allow_http", None)  # s3fs follows the endpoint's scheme
            if options_:
                raise ValueError(
                    f"{where}: client_options {sorted(options_)} are obstore's, which is not "
                    "installed; install obstore (pip install obstore) or drop them."
                )
        elif given.lower() in _S3_ALIASES:
            put(_S3_ALIASES[given.lower()], value, given)
        elif backend == "fsspec" and given.lower() in _S3_OBSTORE_ONLY:
            raise ValueError(
                f"{where}: {given!r} is obstore's and has no fsspec (s3fs) spelling here; "
                "install obstore (pip install obstore) or drop it."
            )
        else:
            rest[given] = value
    if backend == "obstore":
        # An `http://` endpoint is meant as written (as s3fs takes it): obstore refuses one
        # unless its client allows plain HTTP.
        if str(canonical.get("endpoint", "")).startswith("http://"):
            client = rest.setdefault("client_options", {})
            client.setdefault("allow_http", True)
        return {**canonical, **rest}
    out = {_S3_FSSPEC[k]: v for k, v in canonical.items() if k != "region"}
    if "region" in canonical:
        out["client_kwargs"] = {**rest.pop("client_kwargs", {}), "region_name": canonical["region"]}
    return {**rest, **out}


def open_store(store: Any, storage_options: dict | None, read_only: bool) -> Store:
    """A zarr store for `store` (a path, a URL, a `.zip` file or a store)."""
    if isinstance(store, Store):
        if storage_options:
            raise ValueError(
                "Archive(): `storage_options` apply to a URL; this `store` is already a zarr "
                "store: configure the store itself."
            )
        if read_only and not store.read_only:
            return store.with_read_only(True)
        return store
    if not isinstance(store, str | os.PathLike):
        raise TypeError(
            f"Archive(): `store` must be a path, a URL or a zarr store, got {type(store).__name__}."
        )
    s = os.fspath(store)
    if "://" in s and not s.startswith("file://"):
        return _open_url(s, dict(storage_options or {}), read_only)
    if storage_options:
        raise ValueError(
            f"Archive(): `storage_options` apply to a URL such as 's3://bucket/run.zarr', not to "
            f"the local path {s!r}; drop them."
        )
    s = s.removeprefix("file://")
    if s.endswith(".zip"):
        if not read_only:
            raise ValueError(
                f"Archive(): {s!r} is a zip file, which can only be opened with mode='r' "
                "(a zip cannot replace entries atomically): write to a directory, then zip it."
            )
        return sync(zarr.storage.ZipStore.open(s, mode="r"))
    return zarr.storage.LocalStore(s, read_only=read_only)


def _open_url(url: str, options: dict[str, Any], read_only: bool) -> Store:
    s3 = url.split("://", 1)[0] in ("s3", "s3a")
    try:
        from obstore.exceptions import UnknownConfigurationKeyError
        from obstore.store import from_url
    except ImportError:
        pass
    else:
        if s3:
            options = s3_options(options, "obstore")
        try:
            return zarr.storage.ObjectStore(from_url(url, **options), read_only=read_only)
        except UnknownConfigurationKeyError as error:
            raise ValueError(
                f"Archive(): storage_options for {url!r} are passed to obstore, which does not "
                f"take one of them ({error}); spell them as obstore does"
                + (f" ({_OBSTORE_S3_DOCS})." if s3 else ".")
            ) from error
    if not read_only:
        raise ValueError(
            f"Archive(): writing to {url!r} needs obstore (pip install obstore): the one-writer "
            "lock is an object created by a conditional put, which zarr's fsspec store does "
            "not make (it checks, then writes: two writers could both take the lock). Readers "
            "(mode='r') can use fsspec."
        )
    if s3:
        options = s3_options(options, "fsspec")
    try:
        return zarr.storage.FsspecStore.from_url(url, storage_options=options, read_only=True)
    except ImportError as error:
        raise ImportError(
            f"Archive(): reading {url!r} needs obstore (pip install obstore) or fsspec with "
            f"the filesystem of that URL (e.g. s3fs): {error}"
        ) from error


def location_of(store: Any) -> str:
    """How messages and `repr` name a location: the path or URL as given, else the store."""
    if isinstance(store, str | os.PathLike):
        return repr(os.fspath(store))
    return repr(store)


def creates_atomically(store: Store) -> bool:
    """Whether `store.set_if_not_exists` is a conditional put (one atomic request), which the
    writer lock needs: zarr's default checks, then writes, so two writers could both take
    it. A store that overrides it (a local directory, memory, obstore) makes one."""
    inner = getattr(store, "_store", None)  # a wrapper store delegates to the one it wraps
    if isinstance(inner, Store):
        return creates_atomically(inner)
    return type(store).set_if_not_exists is not Store.set_if_not_exists


# ----------------------------------------------------------------------------- objects


def read_json(store: Store, key: str) -> dict | None:
    buf = sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else json.loads(buf.to_bytes())


_TMP_PREFIX = uuid.uuid4().hex[:12]  # temporary file names: unique to this process
_TMP_COUNT = itertools.count()


def fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries (renames), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Objects:
    """Whole-object and byte-range I/O on a store, through zarr's store calls, except the
    writes to a local directory (see the module docstring): each a temporary file (flushed
    to disk with `fsync`) renamed over the object; the folders written to are in `dirs`."""

    def __init__(self, store: Store, fsync: bool):
        self.store = store
        self.root = str(store.root) if isinstance(store, zarr.storage.LocalStore) else None
        self.fsync = fsync and self.root is not None
        # zarr's synchronous store calls, where the store (and the zarr version) has them.
        self.sync_io = callable(getattr(store, "get_sync", None)) and callable(
            getattr(store, "set_sync", None)
        )
        self.dirs: set[str] = set()  # folders written to (on a local directory)

    def get(self, key: str) -> memoryview | None:
        if self.sync_io:
            buf = self.store.get_sync(key)  # pyright: ignore[reportAttributeAccessIssue]
        else:
            buf = sync(self.store.get(key, prototype=default_buffer_prototype()))
        return None if buf is None else memoryview(buf.as_buffer_like())

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview] | None:
        """The bytes `[a, b)` of each range (`a < 0`: the last `-a` bytes) of an object on a
        store, by zarr's coalesced ranged reads (only for objects never replaced while
        read), or None if it does not exist. (A local directory's shards are read at their
        offsets from one open file: `Shards.get_chunks`.)"""
        requests = [SuffixByteRequest(-a) if a < 0 else RangeByteRequest(a, b) for a, b in ranges]
        proto = default_buffer_prototype()
        got: list[Any] = [None] * len(requests)
        store: Any = self.store  # `get_ranges(_sync)` came in zarr 3.2 (Python 3.11 gets 3.1)
        try:
            if self.sync_io and hasattr(store, "get_ranges_sync"):
                for i, buf in store.get_ranges_sync(key, requests, prototype=proto):
                    got[i] = buf
            elif hasattr(store, "get_ranges"):

                async def fetch() -> None:
                    async for group in store.get_ranges(key, requests, prototype=proto):
                        for i, buf in group:
                            got[i] = buf

                sync(fetch())
            else:  # zarr without coalesced reads: one request per range, concurrently

                async def fetch_each() -> list:
                    return await asyncio.gather(*(self.store.get(key, proto, r) for r in requests))

                got = sync(fetch_each())
        except (FileNotFoundError, BaseExceptionGroup) as error:
            if isinstance(error, BaseExceptionGroup) and error.split(FileNotFoundError)[1]:
                raise  # a failure other than a missing object
            return None
        if any(buf is None for buf in got):
            return None
        return [memoryview(buf.as_buffer_like()) for buf in got]

    def put(self, key: str, parts: Sequence[Any]) -> None:
        """Replace the object `key` by the concatenation of `parts` (bytes-like)."""
        if self.root is None:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            buf = default_buffer_prototype().buffer.from_bytes(data)
            if self.sync_io:
                self.store.set_sync(key, buf)  # pyright: ignore[reportAttributeAccessIssue]
            else:
                sync(self.store.set(key, buf))
            return
        path = os.path.join(self.root, key)
        folder = os.path.dirname(path)
        if folder not in self.dirs:
            os.makedirs(folder, exist_ok=True)
            self.dirs.add(folder)
        tmp = f"{path}.{_TMP_PREFIX}{next(_TMP_COUNT)}.partial"
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Replace several objects, each as `put` does (concurrently on an async store, at
        most zarr's `async.concurrency` at a time)."""
        if self.root is not None or self.sync_io:
            for key, data in items:
                self.put(key, [data])
            return
        from zarr.core.common import concurrent_map

        proto = default_buffer_prototype()

        async def put(key: str, data: bytes) -> None:
            await self.store.set(key, proto.buffer.from_bytes(data))

        sync(concurrent_map(list(items), put, limit=zarr.config.get("async.concurrency")))

    def delete(self, key: str) -> None:
        if callable(getattr(self.store, "delete_sync", None)):
            self.store.delete_sync(key)  # pyright: ignore[reportAttributeAccessIssue]
        else:
            sync(self.store.delete(key))


def clean_partial(store: Store) -> None:
    """Remove the temporary files a killed writer may have left in a local directory."""
    if isinstance(store, zarr.storage.LocalStore):
        for p in store.root.rglob("*.partial"):
            p.unlink(missing_ok=True)


# --------------------------------------------------------------------------------- lock


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running. A process that was killed but not yet
    reaped by its parent (a zombie, e.g. a writer its launcher killed) still answers
    `os.kill(pid, 0)`, but will never write again: where `/proc` tells, it counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc (macOS): running, as far as this host can tell
    # The state follows the name, which is in parentheses and may itself hold any bytes.
    state = stat[stat.rfind(b")") + 2 :][:1]
    return state not in (b"Z", b"X")


def _holder(raw: Any) -> dict | None:
    return None if raw is None else json.loads(bytes(raw))["attributes"][LOCK_ATTR]


def _release(objects: Objects, token: str) -> None:
    with contextlib.suppress(Exception):
        held = _holder(objects.get(LOCK_KEY))
        if held is not None and held["token"] == token:
            objects.delete(LOCK_KEY)
            if objects.root is not None:  # no empty directory left behind
                os.rmdir(os.path.dirname(os.path.join(objects.root, LOCK_KEY)))


class WriterLock:
    """The one-writer lock: a small group `_writer_lock` whose attributes name its holder,
    created with a conditional put (so of two writers racing, one wins). A lock left by a
    dead process on this host is broken, any other only with `break_lock`."""

    def __init__(self, objects: Objects, location: str, break_lock: bool):
        store = objects.store
        if not creates_atomically(store):
            raise ValueError(
                f"Archive(): {location} cannot hold the one-writer lock: its store "
                f"({type(store).__name__}) creates an object by checking, then writing, so two "
                "writers could both take it. Write through obstore (pip install obstore: URLs "
                "then open with it; or pass a zarr.storage.ObjectStore) or to a local "
                "directory; any store can be read (mode='r')."
            )
        self.objects = objects
        self.token: str | None = None
        token = uuid.uuid4().hex
        info = {
            "token": token,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        lock = {"zarr_format": 3, "node_type": "group", "attributes": {LOCK_ATTR: info}}
        buf = default_buffer_prototype().buffer.from_bytes(json.dumps(lock).encode())
        other = None
        for attempt in range(2):
            sync(store.set_if_not_exists(LOCK_KEY, buf))
            other = _holder(objects.get(LOCK_KEY))
            if other is not None and other["token"] == token:
                self.token = token
                # Released by close() or at exit (not on garbage collection, which may run
                # on zarr's event-loop thread, where no store call can be made).
                self._finalizer: Callable[[], None] | None = functools.partial(
                    _release, objects, token
                )
                atexit.register(self._finalizer)
                return
            stale = (
                other is not None
                and other["host"] == info["host"]
                and not _pid_alive(int(other["pid"]))
            )
            if attempt == 0 and (stale or break_lock or other is None):
                objects.delete(LOCK_KEY)
                continue
            break
        assert other is not None
        raise ArchiveLockedError(
            f"Archive(): {location} is already open for writing by process {other['pid']} "
            f"on host {other['host']!r} (since {other['since']}); one writer at a time. Open "
            "it with mode='r' to read; if that writer is gone (and the lock is stale), pass "
            f"break_lock=True, or delete the key {LOCK_KEY!r}."
        )

    def check(self, where: str, location: str) -> None:
        """Raise unless this writer still holds the lock."""
        if self.token is None:
            raise PermissionError(f"{where}: the archive was closed; open it again to write.")
        other = _holder(self.objects.get(LOCK_KEY))
        if other is None or other["token"] != self.token:
            self.token = None
            raise ArchiveLockedError(
                f"{where}: this writer's lock on {location} was broken (by another writer "
                "with break_lock=True, or deleted); nothing was written. Open it again."
            )

    def release(self) -> None:
        if self.token is not None and self._finalizer is not None:
            atexit.unregister(self._finalizer)
            self._finalizer()
        self.token = self._finalizer = None


# ------------------------------------------------------------------------------ threads


@functools.cache
def _pool(workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One pool of `workers` threads named `name`, made at its first use."""
    return concurrent.futures.ThreadPoolExecutor(workers, name)


def io_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for chunk I/O: the codecs release the GIL, and so does file I/O."""
    return _pool(_THREADS, "equibuffer-archive")


# Shards a long read fetches ahead of its decoding (each about 16 MiB), on threads of their own:
# a fetch waited on by a decoding thread must never queue behind decoding work.
READ_AHEAD = 3


def fetch_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that read whole objects ahead of the I/O threads' decoding."""
    return _pool(READ_AHEAD, "equibuffer-fetch")


def run_all(work: Callable[[Any], Any], tasks: Iterable[Any], inline: bool = False) -> Iterable:
    """`work` over `tasks` on the I/O threads (in this thread when `inline`), results in
    order."""
    return map(work, tasks) if inline else io_pool().map(work, tasks)
