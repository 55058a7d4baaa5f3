"""The joint-hit lookup of ``AsyncClient`` and the leases it hands out.

- ``LookupCalls`` (a ``ClientSession``): ``lookup(attention_layers, ssm_layers, boundaries |
  token_ids=…, groups=…)`` → ``LookupResult`` (DESIGN §4, on every TP shard); ``release(lease_ids)``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.frames import Op
from statetier.protocol.wire_meta import LookupReply, ReleaseMeta, ReleaseReply, ref_of

from .replies import decoded
from .session import ClientSession
from .values import LayerGroup, LookupResult, boundaries_from_tokens, lookup_meta


class LookupCalls(ClientSession):
    """See the module docstring."""

    # -- lookup and leases --------------------------------------------------------------

    async def lookup(self, attention_layers: Sequence[int] = (), ssm_layers: Sequence[int] = (),
                     boundaries: Sequence[tuple[int, bytes]] | None = None, *,
                     token_ids: Sequence[int] | None = None, block_size: int | None = None,
                     kv_layout: str = "blocks", tp_size: int | None = None, lease: bool = True,
                     groups: Sequence[LayerGroup] = (), group_shards: Sequence[int] = ()) -> LookupResult:
        """The largest prefix that every listed layer and layer group can restore (DESIGN §4,
        joint hits), on every TP shard: ``tp_size`` defaults to the ``NamespaceSpec``'s (1
        without one). A KV group needs its group objects (one per block, or ``[0, N)`` with
        ``kv_layout="prefix"``), an SSM group its group object at the boundary. ``group_shards``
        (one count per group, or none) says on how many shards (0 … n-1) a group's objects are:
        1 for a state every TP rank holds the same and stores once, as shard 0.

        Give ``boundaries`` as ascending ``(token_end, prefix_hash)`` pairs, or ``token_ids``
        (hashed per ``block_size``, by default the namespace's ``kv_block_size``). Leased
        objects stay pinned until ``release(result.lease_ids)``.
        """
        if (boundaries is None) == (token_ids is None):
            raise InvalidRequest("lookup takes either boundaries or token_ids")
        if token_ids is not None:
            size = block_size or (self.spec.kv_block_size if self.spec else None)
            if not size:
                raise InvalidRequest("lookup by token_ids needs block_size (or a NamespaceSpec)")
            boundaries = boundaries_from_tokens(token_ids, size, self.spec.hash_seed if self.spec else 0)
        assert boundaries is not None  # given, or made from token_ids
        meta = lookup_meta(self._own_namespace().digest, attention_layers, ssm_layers, boundaries, kv_layout=kv_layout,
                           lease=lease,
                           tp_size=tp_size if tp_size is not None else (self.spec.tp_size if self.spec else 1),
                           groups=groups, group_shards=group_shards)
        reply = decoded(LookupReply, await self._request(Op.LOOKUP, meta))
        return LookupResult(reply.tokens, [(ref_of(ref), lease) for ref, lease in reply.objects])

    async def release(self, lease_ids: Iterable[int]) -> int:
        """Give leases back (from ``lookup``); returns how many the daemon still held."""
        leases = [int(x) for x in lease_ids]
        if not leases:
            return 0
        return decoded(ReleaseReply, await self._request(Op.RELEASE, ReleaseMeta(tuple(leases)))).released
