"""Which coroutine answers which opcode: ``HANDLERS`` (``Op`` → handler), for ``request_task``."""

from __future__ import annotations

from statetier.protocol.frames import Op

from .load_handlers import handle_load, handle_load_batch
from .put_handlers import handle_put, handle_put_batch
from .handlers import (
    Handler,
    handle_delete,
    handle_inspect,
    handle_lookup,
    handle_ping,
    handle_release,
    handle_stats,
    handle_verify,
    traced,
)

HANDLERS: dict[Op, Handler] = {
    Op.PING: handle_ping,
    Op.PUT: traced(handle_put),
    Op.LOAD: traced(handle_load),
    Op.LOAD_BATCH: traced(handle_load_batch),
    Op.PUT_BATCH: traced(handle_put_batch),
    Op.RELEASE: handle_release,
    Op.LOOKUP: traced(handle_lookup),
    Op.DELETE: handle_delete,
    Op.STATS: handle_stats,
    Op.INSPECT: handle_inspect,
    Op.VERIFY: handle_verify,
}
