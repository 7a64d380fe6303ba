"""The block protocol's dispatcher: one table from op name to handler, a request run on a worker
thread (``handle``) or by the event loop itself when it waits on nothing (``handle_now``),
and every failure mapped to a ProtocolError code (the connection sends it as an error frame).

The handlers are in block_ops (data), shm_ops (shared memory) and manage_ops (cache
management), each given the daemon's parts as an ``OpContext``; a new op is a function in
one of them and an entry in its ``HANDLERS``. The dispatcher also counts requests per op and
errors per code (``/metrics``, ``/v1/stats``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvstore.errors import (
    CapacityError,
    CodecError,
    ConfigError,
    KVStoreError,
    LayoutMismatchError,
    TierError,
    TierFullError,
)
from kvstore.protocol import Code, ProtocolError
from kvstore.services.daemon import block_ops, manage_ops, shm_ops
from kvstore.services.daemon.host_slots import ReservedPut, cancel_put, reserve_put
from kvstore.services.daemon.op_context import Handler, NowHandler, OpContext, Reply
from kvstore.services.daemon.session import Session

log = logging.getLogger("kvstore.services.daemon")

HANDLERS: Mapping[str, Handler] = {**block_ops.HANDLERS, **shm_ops.HANDLERS, **manage_ops.HANDLERS}
# Ops the event loop may run itself: a put received into reserved slots and a write lease's
# commit, when they stay in memory and find the store lock free.
RUN_NOW: Mapping[str, NowHandler] = {**block_ops.RUN_NOW, **shm_ops.RUN_NOW}

Data = bytes | bytearray | ReservedPut


class Dispatcher:
    """Runs the requests of every connection; thread-safe as its handlers are."""

    def __init__(self, context: OpContext) -> None:
        self.context = context
        self.requests: Counter[str] = Counter()  # requests run, by op, whether they succeeded or failed
        self.errors: Counter[str] = Counter()  # error frames, by code name

    def handle(self, session: Session, meta: dict[str, Any], data: Data) -> Reply:
        """Run one request; returns (meta, data) of the response or of an error frame."""
        reply = self._run(session, meta, data, now=False)
        assert reply is not None
        return reply

    def handle_now(self, session: Session, meta: dict[str, Any], data: Data) -> Reply | None:
        """Run a request on the caller's thread (the event loop's) only if it waits on
        nothing (``RUN_NOW``). None: nothing was done; run ``handle`` on a worker."""
        op = meta.get("op")
        if session.principal is None or not isinstance(op, str) or op not in RUN_NOW:
            return None
        return self._run(session, meta, data, now=True)

    def reserve_put(self, session: Session, meta: dict[str, Any], data_len: int, *,
                    blocking: bool = True) -> ReservedPut | None:
        """Host slots to receive a put's data in (kvstore/services/daemon/host_slots.py)."""
        return reserve_put(self.context, session, meta, data_len, blocking=blocking)

    def cancel_put(self, reserved: ReservedPut) -> None:
        """Give a reserved put's slots back (its connection closed before the data came)."""
        cancel_put(reserved)

    def _run(self, session: Session, meta: dict[str, Any], data: Data, *, now: bool) -> Reply | None:
        rid = meta.get("id")
        # only an integer id is echoed, in replies and error frames alike: one of another type
        # (a binary of nearly max_frame bytes, say) would push the reply past the frame cap
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        op = meta.get("op")
        ran: str | None = None  # the op, once it runs: a request, whether it succeeds or fails
        try:
            if not isinstance(op, str):
                raise ProtocolError(Code.BAD_REQUEST, "field 'op' must be a string")
            handler = HANDLERS.get(op)
            if handler is None:
                raise ProtocolError(Code.UNKNOWN_OP, f"unknown op {op[:40]!r}")
            if op == "hello" and session.principal is not None:
                raise ProtocolError(Code.STATE, "hello was already sent on this connection")
            if op != "hello" and session.principal is None:
                raise ProtocolError(Code.STATE, f"op {op!r} before hello")
            ran = op
            reply = RUN_NOW[op](self.context, session, meta, data) if now else handler(self.context, session, meta, data)
            if reply is None:
                ran = None  # nothing was done: the worker's run is the request
                return None
            out, payload = reply
            out["id"] = rid
            return out, payload
        except ProtocolError as exc:
            code, message = exc.code, exc.message
        except KeyError as exc:
            code, message = Code.NOT_FOUND, str(exc.args[0] if exc.args else exc)
        except (CapacityError, TierFullError) as exc:  # a full disk is no room, as a full pool is
            code, message = Code.CAPACITY, str(exc)
        except (LayoutMismatchError, ConfigError) as exc:
            code, message = Code.LAYOUT, str(exc)
        except TierError as exc:  # e.g. a write-through put whose disk write failed: not acknowledged
            code, message = Code.STORAGE, str(exc)
        except CodecError as exc:  # a block the store's codec refuses (NaN, a scale out of range)
            code, message = Code.BAD_REQUEST, str(exc)
        except KVStoreError as exc:  # the store is closed: the daemon is going away
            code, message = Code.SHUTDOWN, str(exc)
        except (TypeError, ValueError) as exc:
            code, message = Code.BAD_REQUEST, str(exc)
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("op %r failed", op)
            code, message = Code.INTERNAL, f"{type(exc).__name__}: {exc}"
        finally:
            if ran is not None:
                self.requests[ran] += 1
        self.errors[code.name] += 1
        if session.state is not None and session.principal is not None:
            session.state.count(session.principal.tenant, errors=1)
        return {"id": rid, "error": {"code": int(code), "message": message[:2000]}}, b""
