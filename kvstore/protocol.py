"""The block protocol's wire format: length-prefixed msgpack frames (docs/protocol.md).

A frame is an 8-byte header (two big-endian u32: ``meta_len``, ``data_len``), then
``meta_len`` bytes of one msgpack map, then ``data_len`` raw bytes (block payloads, or empty).
Block bytes travel outside msgpack so each side can move them with one copy. The lengths
are checked against the cap before a single body byte is read. Bodies decode with
hard limits (strings, binaries, arrays, maps, nesting); extension types are refused. Nothing
here ever unpickles.
"""

from __future__ import annotations

import enum
import socket
import struct
from typing import Any

import msgpack

from kvstore.errors import ConfigError, KVStoreError
from kvstore.layout import DTYPES_BY_NAME, KVGroup, KVLayout

VERSION = 1
HEADER = struct.Struct(">II")
DEFAULT_MAX_FRAME = 64 << 20
MAX_ITEMS = 1 << 16  # array / map entries in one frame
OPS = ("hello", "lookup", "get", "put", "exists", "pin", "unpin", "delete", "stats",
       "reserve", "commit", "release", "touch", "prefetch", "prefetch_status", "inspect", "forget")


class Code(enum.IntEnum):
    """Error codes carried by error frames (``{"id", "error": {"code", "message"}}``)."""

    BAD_FRAME = 1  # not a msgpack map, or malformed msgpack
    TOO_LARGE = 2  # length prefix above the cap (the connection is then closed)
    BAD_REQUEST = 3  # a field is missing or has the wrong type or size
    UNKNOWN_OP = 4
    VERSION = 5  # hello with an unsupported protocol version
    AUTH = 6  # missing or unknown token
    NOT_FOUND = 7  # a key the op needs is not in the store
    CAPACITY = 8  # no room: everything pinned or in flight
    LAYOUT = 9  # layout or namespace problem (bad layout, namespace slots full)
    STATE = 10  # op before hello, or hello twice
    LEASE = 11  # unknown or expired shared-memory lease
    BUSY = 12  # too many connections
    SHUTDOWN = 13  # the daemon is draining
    INTERNAL = 14  # a bug: the message says what; the daemon keeps serving
    STORAGE = 15  # the store's medium failed (an I/O error, a corrupt catalog): the op was not done


class ProtocolError(Exception):
    """An error to send back as an error frame."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(f"{code.name} ({int(code)}): {message}")
        self.code = code
        self.message = message


class RemoteError(KVStoreError):
    """Raised by the client for an error frame from the daemon."""

    def __init__(self, code: int, message: str) -> None:
        name = Code(code).name if code in Code._value2member_map_ else "UNKNOWN"
        super().__init__(f"daemon error {name} ({code}): {message}")
        self.code = code
        self.message = message


class RemoteBadRequest(RemoteError, ValueError):
    """An error frame with code BAD_REQUEST (also a ValueError, as TieredStore raises)."""


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def encode(body: dict[str, Any], data_len: int = 0) -> bytes:
    """Header + msgpack meta of one frame; the ``data_len`` raw bytes follow it on the wire."""
    meta = msgpack.packb(body, use_bin_type=True)
    return HEADER.pack(len(meta), data_len) + meta


def check_lengths(meta_len: int, data_len: int, max_frame: int) -> None:
    if meta_len + data_len > max_frame:
        raise ProtocolError(Code.TOO_LARGE, f"frame of {meta_len} + {data_len} bytes exceeds the cap of {max_frame}")


def decode(payload: bytes | bytearray, max_frame: int) -> dict[str, Any]:
    """Decode one body; ProtocolError(BAD_FRAME) unless it is a msgpack map with str keys."""
    try:
        body = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True,
            max_bin_len=max_frame, max_str_len=1 << 20, max_array_len=MAX_ITEMS, max_map_len=256,
        )
    except Exception as exc:  # msgpack raises many kinds (ExtraData, StackError, ValueError...)
        raise ProtocolError(Code.BAD_FRAME, f"undecodable msgpack: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(body, dict):
        raise ProtocolError(Code.BAD_FRAME, f"a frame must hold a map, got {type(body).__name__}")
    return body


def error_body(request_id: Any, code: Code, message: str) -> dict[str, Any]:
    rid = request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else None
    return {"id": rid, "error": {"code": int(code), "message": message}}


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Blocking read of exactly ``n`` bytes; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"daemon closed the connection ({got} of {n} bytes read)")
        got += k
    return buf


def recv_meta(sock: socket.socket, max_frame: int) -> tuple[dict[str, Any], int]:
    """Blocking read of one frame's meta (the client side); returns it and ``data_len``.

    The caller then reads exactly ``data_len`` bytes (``recv_exact``/``recv_into_view``).
    """
    meta_len, data_len = HEADER.unpack(recv_exact(sock, HEADER.size))
    if meta_len + data_len > max_frame:
        raise ConnectionError(f"daemon sent a {meta_len + data_len}-byte frame, above the cap of {max_frame}")
    return decode(bytes(recv_exact(sock, meta_len)), max_frame), data_len


def recv_into_view(sock: socket.socket, view: memoryview) -> None:
    """Blocking read that fills ``view`` exactly (block bytes straight into their tensor)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"daemon closed the connection ({got} of {n} data bytes read)")
        got += k


# ------------------------------------------------------------------------- field checks


def field_of(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """``body[name]`` if it has type ``kind``; ProtocolError(BAD_REQUEST) otherwise."""
    if name not in body:
        if default is ...:
            raise ProtocolError(Code.BAD_REQUEST, f"missing field {name!r}")
        return default
    value = body[name]
    if isinstance(value, bool) and kind in (int, float):
        raise ProtocolError(Code.BAD_REQUEST, f"field {name!r} must be a number, got bool")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProtocolError(Code.BAD_REQUEST, f"field {name!r} must be {want}, got {type(value).__name__}")
    return value


def split_keys(blob: bytes, key_bytes: int) -> list[bytes]:
    """``keys`` travel as one binary: n keys of ``key_bytes`` each, concatenated."""
    if len(blob) % key_bytes:
        raise ProtocolError(Code.BAD_REQUEST, f"keys are {len(blob)} bytes, not a multiple of {key_bytes}")
    return [blob[i : i + key_bytes] for i in range(0, len(blob), key_bytes)]


# The hello frame's layout: KVLayout as a msgpack map, and back (refusing anything else). A
# layout with KV groups adds "groups": [[kind, [layers...], window or nil], ...]; one without
# them is the map it always was.
_LAYOUT_KEYS = frozenset({"num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "tp_rank", "tp_size"})


def layout_to_dict(layout: KVLayout) -> dict[str, Any]:
    out: dict[str, Any] = {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                           "head_dim": layout.head_dim, "block_size": layout.block_size, "dtype": layout.dtype_name,
                           "tp_rank": layout.tp_rank, "tp_size": layout.tp_size}
    if layout.groups:
        out["groups"] = [[g.kind, list(g.layers), g.window] for g in layout.groups]
    return out


def layout_from_dict(d: Any) -> KVLayout:
    """ConfigError for anything but the dict layout_to_dict writes."""
    if not isinstance(d, dict) or not _LAYOUT_KEYS <= set(d) <= _LAYOUT_KEYS | {"groups"}:
        raise ConfigError(f"layout must be a map with keys {sorted(_LAYOUT_KEYS)} (and optionally 'groups')")
    if d["dtype"] not in DTYPES_BY_NAME:
        raise ConfigError(f"layout dtype must be one of {sorted(DTYPES_BY_NAME)}, got {d['dtype']!r}")
    fields = {**d, "dtype": DTYPES_BY_NAME[d["dtype"]]}
    if "groups" in d:
        groups = d["groups"]
        if not isinstance(groups, list) or not all(isinstance(g, list) and len(g) == 3 and isinstance(g[1], list)
                                                   for g in groups):
            raise ConfigError("layout groups must be a list of [kind, [layers...], window]")
        fields["groups"] = tuple(KVGroup(kind, tuple(layers), window) for kind, layers, window in groups)
    return KVLayout(**fields)
