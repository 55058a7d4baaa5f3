"""Fixtures shared by the vLLM connector's tests (tests/clients/test_vllm_*.py).

``engines`` makes connector engines over the requesting module's ``daemon`` fixture (each
module starts its own daemon) and closes them after the test.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_connector import Engine, hybrid_layout, make_engine


@pytest.fixture
def engines(daemon):
    made: list[Engine] = []

    def make(layout=None, **kwargs) -> Engine:
        made.append(make_engine(daemon, layout or hybrid_layout(), **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
