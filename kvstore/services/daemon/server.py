"""The daemon: asyncio servers for the block protocol (Unix socket, TCP) and REST (uvicorn).

Lifecycle: start (reopen namespaces, bind, print where it listens) -> serve, with a tick
every second (expire leases; check integrity when idle) -> SIGTERM/SIGINT: stop accepting,
finish in-flight requests (up to ``drain_s``), close the stores, exit 0; a second signal
exits at once. Store calls run on a worker pool; the event loop only frames bytes. A start
that fails (a taken address, a data directory another daemon holds) is a ConfigError: what
it had opened is closed and its socket file removed.

Connections (framing, back-pressure, receiving a put's blocks straight into host slots) are
``kvstore.services.daemon.connection.Connection``: one connection holds at most ``max_inflight``
requests and responses, each at most ``max_frame`` bytes, however slowly its client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError, TierError
from kvstore.protocol import ProtocolError
from kvstore.services.common.http import bind, freeze_start_heap, stop_on_signals, uvicorn_server
from kvstore.services.common.net import parse_hostport
from kvstore.services.common.tokens import Tokens
from kvstore.services.daemon.config import DaemonConfig
from kvstore.services.daemon.connection import Connection
from kvstore.services.daemon.dispatch import Dispatcher
from kvstore.services.daemon.op_context import OpContext
from kvstore.services.daemon.registry import Registry
from kvstore.services.daemon.session import Session
from kvstore.services.daemon.shm import Leases, leases_per_connection

log = logging.getLogger("kvstore.services.daemon")
INTEGRITY_EVERY_S = 60.0


class Daemon:
    """One ``kvstore serve`` process."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        tokens = Tokens(config.token, config.tokens_file)
        exposed = config.off_loopback()
        if exposed and tokens.is_open:  # the loaded tokens decide, not whether a file was named
            raise ConfigError(f"{exposed[0]} is off loopback: a token is required "
                              "(--token, KVSTORE_TOKEN or a tokens file that defines one)")
        self.registry = Registry(config, tokens)
        self.leases = Leases(config.lease_s, max_per_conn=leases_per_connection(config.max_inflight))
        self.ops = Dispatcher(OpContext(config, self.registry, self.leases))
        self.pool = ThreadPoolExecutor(max(4, 2 * (os.cpu_count() or 2)), thread_name_prefix="kvstore-op")
        self.addresses: list[str] = []
        self.num_inflight = 0
        self.num_connections = 0
        self.started = time.time()
        self._ids = itertools.count(1)
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._http: Any = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file it bound
        self._stop = asyncio.Event()
        self.kv_events: Any = None  # an EventPublisher once started with kv_events

    # ------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open and bind everything; ConfigError for what the operator must fix."""
        cfg = self.config
        _make_data_dir(cfg.data_dir)
        loop = asyncio.get_running_loop()
        if cfg.kv_events:
            self._start_kv_events()
        await loop.run_in_executor(self.pool, self._reopen_existing)
        if cfg.store_settings.remote_url is not None:
            await loop.run_in_executor(self.pool, self._probe_remote)
        if cfg.socket_path:
            self._servers.append(await self._start_unix(Path(cfg.socket_path)))
        if cfg.listen:
            sock = bind(*parse_hostport(cfg.listen))  # a taken port or unknown host is a ConfigError
            server = await loop.create_server(lambda: Connection(self, "tcp"), sock=sock)
            self._servers.append(server)
            self.addresses.append(f"tcp://{_fmt(sock.getsockname())}")
        if cfg.http:
            self.addresses.append(await self._start_http(*parse_hostport(cfg.http)))

    def _probe_remote(self) -> None:
        """Say at once when no seed node of the remote tier answers: the daemon still serves
        (the remote is a cache: its misses are misses), but an operator should know now, not
        from the remote's counters later. The URL is shown without its password."""
        from kvstore.tiers.remote.url import parse_url

        settings = self.config.store_settings
        assert settings.remote_url is not None
        url = parse_url(settings.remote_url)
        errors = []
        for host, port in url.nodes:
            try:
                socket.create_connection((host, port), timeout=settings.remote_timeout_s).close()
                return
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc.strerror or exc}")
        print(f"kvstore serve: warning: no node of the remote tier {url.redacted()} answers ({'; '.join(errors)}); "
              "serving without it until it does", file=sys.stderr, flush=True)

    def _reopen_existing(self) -> None:
        try:
            self.registry.reopen_existing()
        except ConfigError:
            raise
        except (TierError, ProtocolError, OSError, ValueError) as exc:  # e.g. another daemon's disk lock
            raise ConfigError(f"cannot reopen --data-dir {self.config.data_dir}: {exc}") from None

    async def _start_unix(self, path: Path) -> asyncio.AbstractServer:
        """The Unix socket, mode 0600 from its creation: bound under umask 0177 (the umask is
        the process's, so it is set only around the bind)."""
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        umask = os.umask(0o177)
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {path}: {exc.strerror or exc}") from None
        finally:
            os.umask(umask)
        st = os.lstat(path)
        self._socket_id = (st.st_dev, st.st_ino)
        server = await asyncio.get_running_loop().create_unix_server(lambda: Connection(self, "unix"), sock=sock)
        self.addresses.append(f"unix://{path.resolve()}")
        return server

    def _remove_socket(self) -> None:
        """Unlink the socket file this daemon bound, unless another has replaced it since."""
        if self._socket_id is None or not self.config.socket_path:
            return
        with contextlib.suppress(OSError):
            st = os.lstat(self.config.socket_path)
            if (st.st_dev, st.st_ino) == self._socket_id:
                os.unlink(self.config.socket_path)
        self._socket_id = None

    def _start_kv_events(self) -> None:
        """Publish every namespace's tiers (each store is attached as the registry opens it)."""
        from kvstore.events import EventPublisher, EventsConfig
        from kvstore.events.store_events import StoreEvents

        assert self.config.kv_events
        self.kv_events = publisher = EventPublisher(EventsConfig(self.config.kv_events, self.config.kv_events_replay))
        def attach(store: Any) -> None:
            StoreEvents(publisher, store).attach()

        self.registry.on_open.append(attach)
        replay = f" (replay {publisher.replay_endpoint})" if publisher.replay_endpoint else ""
        print(f"kvstore serve: kv events on {publisher.endpoint}{replay}", flush=True)

    async def _start_http(self, host: str, port: int) -> str:
        from kvstore.services.daemon.rest import create_app  # FastAPI loads only where REST is served

        sock = bind(host, port)  # TCP_NODELAY; a taken port is a ConfigError
        app = create_app(self.registry, admin_token=self.config.token, daemon=self)
        self._http = uvicorn_server(app)  # the daemon owns the signals
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        for _ in range(1000):  # "ready" is printed only once REST accepts connections
            if self._http.started or self._http_task.done():
                break
            await asyncio.sleep(0.01)
        if not self._http.started:
            raise RuntimeError(f"the REST server did not start on {host}:{port}")
        return f"http://{_fmt(sock.getsockname())}"

    async def run(self) -> int:
        """Start, serve until a signal, drain, close. Returns the exit status."""
        self._stop = stop_on_signals(asyncio.get_running_loop())
        try:
            await self.start()
        except Exception:
            with contextlib.suppress(Exception):  # leave nothing behind; the start's error is the one to show
                await self.shutdown(time.monotonic() + 1.0)
            raise
        freeze_start_heap()
        print(f"kvstore serve: listening on {', '.join(self.addresses)} (pid {os.getpid()}); ready", flush=True)
        tick = asyncio.create_task(self._tick())
        await self._stop.wait()
        deadline = time.monotonic() + self.config.drain_s
        tick.cancel()
        await self.shutdown(deadline)
        print("kvstore serve: stopped", flush=True)
        return 0

    async def shutdown(self, deadline: float) -> None:
        for server in self._servers:
            server.close()
        if self._http is not None:
            self._http.should_exit = True
        for conn in list(self._connections):
            conn.stop()
        while self._handlers and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for task in list(self._handlers):
            task.cancel()
        if self._http is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._http_task, max(0.1, deadline - time.monotonic()))
        loop = asyncio.get_running_loop()
        closing = loop.run_in_executor(self.pool, self.registry.close)
        try:
            await asyncio.wait_for(closing, max(0.5, deadline + 0.8 - time.monotonic()))
        except asyncio.TimeoutError:
            print("kvstore serve: stores did not close in time; exiting (unacknowledged data only is lost)",
                  file=sys.stderr, flush=True)
        if self.kv_events is not None:
            self.kv_events.close()  # ends with AllBlocksCleared
        self._remove_socket()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last_check = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            await loop.run_in_executor(self.pool, self.leases.expire)
            if self.num_inflight == 0 and time.monotonic() - last_check > INTEGRITY_EVERY_S:
                last_check = time.monotonic()
                await loop.run_in_executor(self.pool, self._check_integrity)

    def _check_integrity(self) -> None:
        for state in self.registry.namespaces():
            try:
                state.store.check_integrity()
            except AssertionError as exc:
                log.error("integrity check failed for namespace %s: %s", state.id, exc)
                print(f"kvstore serve: INTEGRITY CHECK FAILED in {state.id}: {exc}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------ connections
    # Each connection is a kvstore.services.daemon.connection.Connection; these are its hooks
    # (the daemon is its ConnectionHost).

    @property
    def is_stopping(self) -> bool:
        return self._stop.is_set()

    def next_conn_id(self) -> int:
        return next(self._ids)

    def connection_opened(self, conn: Connection) -> None:
        self.num_connections += 1
        self._connections.add(conn)

    async def connection_closed(self, conn: Connection) -> None:
        """A connection's in-flight requests finish (up to ``drain_s``), then its pins and leases end."""
        try:
            if conn.tasks:
                await asyncio.wait(conn.tasks, timeout=max(0.0, self.config.drain_s))
        finally:
            self.num_connections -= 1
            self._connections.discard(conn)
            await self.end_session(conn)

    async def end_session(self, conn: Connection) -> None:
        """End a connection's pins and leases (again, harmlessly, if they have ended)."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await loop.run_in_executor(self.pool, self._end_session, conn.session)

    def track(self, task: asyncio.Task[None]) -> None:
        """Count a request's task as in flight until it ends (shutdown waits for these)."""
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def _end_session(self, session: Session) -> None:
        self.leases.drop_connection(session.conn_id)
        session.unpin_all()


def _make_data_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--data-dir {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --data-dir {path}: {exc.strerror or exc}") from None


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a dead daemon (connecting is refused). Never anything
    else: ConfigError for a path that is not a socket (a file, a directory, a symlink) or
    one a live daemon answers on."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"--socket {path}: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"--socket {path} exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:  # nobody listens: a dead daemon's
        path.unlink()
    except OSError as exc:  # EAGAIN (a live daemon's full backlog), EACCES...: not ours to remove
        raise ConfigError(f"--socket {path} exists and cannot be probed ({exc.strerror or exc}); "
                          "not removing it") from None
    else:
        raise ConfigError(f"another daemon is listening on {path}")
    finally:
        probe.close()


def _fmt(addr: Any) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve(config: DaemonConfig) -> int:
    """Run the daemon in this process until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(Daemon(config).run())
