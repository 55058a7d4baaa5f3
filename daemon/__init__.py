"""statetier.daemon — the sidecar: composition root, engine, server, config, metrics, CLI.

- ``app``        — builds tiers and wires everything (the only module naming tier classes)
- ``engine``     — puts, loads, leases, verification, promotion (``placement``, ``lookup``,
                   ``tenancy`` beside it)
- ``server``     — sockets, frames, authentication (``auth``), backpressure (``budget``)
- ``config``     — the one pydantic configuration; ``metrics``/``http`` — Prometheus
- ``cli``        — the ``statetier`` command
"""
