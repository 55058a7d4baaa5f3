"""Which coroutine answers which opcode: ``HANDLERS`` (``Op`` → handler), for ``request_task``.

The hot ops' handlers take their typed binary meta (``handlers.hot`` decodes it with
``protocol.wire_meta.REQUESTS``); the admin ops' take the frame and its JSON meta.
"""

from __future__ import annotations

from statetier.protocol.frames import Op
from statetier.protocol.wire_meta import REQUESTS

from .handlers import (
    Handler,
    HotHandler,
    handle_delete,
    handle_inspect,
    handle_list,
    handle_lookup,
    handle_ping,
    handle_purge,
    handle_release,
    handle_stats,
    handle_verify,
    hot,
)
from .load_handlers import handle_load, handle_load_batch
from .put_handlers import handle_put, handle_put_batch

_HOT: dict[Op, HotHandler] = {
    Op.PUT: handle_put, Op.PUT_BATCH: handle_put_batch, Op.LOAD: handle_load, Op.LOAD_BATCH: handle_load_batch,
    Op.LOOKUP: handle_lookup, Op.RELEASE: handle_release}

HANDLERS: dict[Op, Handler] = {
    **{op: hot(REQUESTS[op], handler) for op, handler in _HOT.items()},
    Op.PING: handle_ping,
    Op.DELETE: handle_delete,
    Op.STATS: handle_stats,
    Op.INSPECT: handle_inspect,
    Op.VERIFY: handle_verify,
    Op.LIST: handle_list,
    Op.PURGE: handle_purge,
}

# The admin ops read a JSON map; a MessagePack meta (the binary flag) on one is refused by name
# before its handler sees bytes where it expects a map. PING reads no meta.
JSON_OPS = frozenset(HANDLERS) - frozenset(_HOT) - {Op.PING}
