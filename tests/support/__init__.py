"""What the test suites share; tests import it as ``tests.support.<module>``.

pytest puts the repository root on ``sys.path`` (``pythonpath`` in pyproject.toml) and the
test folders are packages, so nothing here or in a test edits ``sys.path``.

- ``waiting`` — ``wait_until`` / ``eventually``: bounded polls of background state.
- ``clock`` — ``ManualClock``, a clock the tiers accept (``clock=``) that a test advances.
- ``scripts`` — ``REPO`` and ``module_command``: helpers run as processes (``python -m``).
- ``keyrings`` — ``keyring_file``: one keyring on disk for several daemons.
- ``daemons`` — ``daemon_fixture`` (a ``statetier serve`` subprocess for a fixture),
  ``arena_copy``; ``jamba`` — Jamba-mini state; ``server_harness`` — an in-process server and
  a raw-frame client; ``engine_objects`` — the engine tests' snapshots.
- ``tier_contract`` — the cross-tier contract fixtures and steps; ``host_tier``,
  ``redis_tier``, ``disk_files``, ``disk_crash_writer`` (also a subprocess) — per tier;
  ``peer_wire`` — fake owners speaking the peer wire (an owner of an older release).
- ``tenant_worker`` — a tenant's worker under another uid (a subprocess).
- ``kv_event_schema`` — vLLM's KV event Structs; ``sglang_pools`` — SGLang's host pools.
- ``fault_harness`` — the fault suite's scenarios; ``deploy_files``, ``prometheus_proc`` —
  the deploy folder's files and a real Prometheus.
"""
