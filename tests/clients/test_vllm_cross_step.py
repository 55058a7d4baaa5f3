"""The vLLM connector's transfers across steps, against a real daemon that is stopped under them.

The daemon is a real process; ``stopped(daemon)`` SIGSTOPs it (and SIGCONTs it after), so
that every call the connector makes meanwhile goes unanswered. The story: a lookup never
holds the step (``matched_tokens`` answers ``None``, then a counted miss at the deadline, and
at once while the daemon is suspect); a load that does not end in time is abandoned and
reported failed, and nothing lands after; a save never holds its step past the deadline;
its blocks stay with the connector until it has ended (``finished_sending``); a Mamba slot
written again after ``wait_for_save`` returned does not change what was saved; a preempted
request's saves end (or are dropped, sending nothing more) before ``flush`` returns.
A call that blocked on the stopped daemon would hang the test: the hang is the failure.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from tests.support.daemons import daemon_fixture
from tests.support.vllm_connector import (
    ATTN, CONSUMER_BLOCKS, MAMBA, PRODUCER_BLOCKS, FakeRequest, ask, load, prefill, tokens)

from statetier.clients import Client
from statetier.clients.vllm.link import _allowed_cpus, _cpu_ids, connector_cpus
from statetier.clients.vllm.scheduler import ScheduledStep
from statetier.protocol.errors import ClientClosedError

DEADLINE = 0.5


@pytest.fixture(scope="module")
def daemon(request):
    return daemon_fixture(request, metrics=False, name="vllmxstep")


@contextmanager
def stopped(daemon):
    daemon.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        daemon.send_signal(signal.SIGCONT)


def past_deadline() -> None:
    """Let the deadline pass (the connector measures it; the test only waits it out)."""
    time.sleep(DEADLINE * 1.5)


def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_lookup_never_holds_the_step_and_an_unanswered_one_is_a_counted_miss(engines, daemon) -> None:
    producer = engines(role="producer", seed=21)
    consumer = engines(role="consumer", seed=None, deadline=DEADLINE)
    prompt = tokens(21, 40)
    prefill(producer, FakeRequest("p-21", prompt), PRODUCER_BLOCKS, seed=21)
    consumer.scheduler.link.connected()  # connected (waited on): what follows is the daemon's silence
    with stopped(daemon):
        request = FakeRequest("c-21", prompt)
        assert consumer.scheduler.matched_tokens(request, 0) is None  # asked, not waited on
        past_deadline()
        assert consumer.scheduler.matched_tokens(request, 0) == 0     # the deadline passed: a miss
        assert consumer.scheduler.matched_tokens(request, 0) == 0     # and the same answer again
        # the daemon is suspect now: the next request misses at once, without asking it
        assert consumer.scheduler.matched_tokens(FakeRequest("c-21b", prompt), 0) == 0
        assert consumer.scheduler.counts.take() == {
            "lookups": 2, "misses.deadline": 1, "deadline_misses.lookup": 1, "misses.unavailable": 1}
        delay_free, handoff = consumer.scheduler.request_finished(request)
        assert (delay_free, handoff) == (False, None)
    # answered again: the late answer's leases went back, and lookups hit
    with Client(daemon.url, use_shm=False) as observer:
        _until(lambda: observer.stats()["leases"] == 0)
    assert ask(consumer.scheduler, FakeRequest("c-21c", prompt)) == 32
    consumer.scheduler.request_finished(FakeRequest("c-21c", prompt))


def test_a_load_past_the_deadline_is_abandoned_reported_failed_and_never_lands(engines, daemon) -> None:
    producer = engines(role="producer", seed=22)
    planner = engines(role="consumer", seed=None)  # its lookup has all the time it needs on a busy machine
    consumer = engines(role="consumer", seed=None, deadline=DEADLINE)
    prompt = tokens(22, 40)
    prefill(producer, FakeRequest("p-22", prompt), PRODUCER_BLOCKS, seed=22)
    request = FakeRequest("c-22", prompt)
    assert ask(planner.scheduler, request) == 32
    planner.scheduler.after_alloc(request, CONSUMER_BLOCKS, 32)
    loads = planner.scheduler.build_meta([]).loads
    consumer.worker.link.connected()
    with stopped(daemon):
        consumer.worker.start_loads(loads)
        assert consumer.worker.take_results() == type(consumer.worker.take_results())()  # on its way
        past_deadline()
        consumer.worker.take_results()   # past the deadline: the connection is dropped
        consumer.worker.wait_idle()      # the load's call ends (its connection went)
        results = consumer.worker.take_results()
    assert results.finished == {"c-22"} and results.failed == {"c-22"}
    assert consumer.worker.take_failed_blocks() == {5, 7}
    assert all(not t.any() for t in consumer.buffers.values())  # nothing landed, then or later
    assert consumer.worker.counts.take() == {"deadline_misses.load": 1, "refusals.deadline": 1}


def test_saves_never_hold_a_step_past_the_deadline_and_keep_their_blocks_until_done(engines, daemon) -> None:
    producer = engines(role="producer", seed=23, deadline=DEADLINE)
    consumer = engines(role="consumer", seed=None)
    prompt = tokens(23, 40)
    request, other = FakeRequest("p-23", prompt), FakeRequest("q-23", tokens(26, 40))
    producer.scheduler.after_alloc(request, PRODUCER_BLOCKS, 0)
    producer.scheduler.after_alloc(other, PRODUCER_BLOCKS, 0)
    slot = PRODUCER_BLOCKS[0][0]

    def written_by_vllm(change) -> None:
        for name in MAMBA:
            for view in producer.worker.states(name, slot).values():
                change(view)

    written_by_vllm(lambda view: view.copy_(torch.randn(view.shape)))
    with stopped(daemon):
        first = producer.scheduler.build_meta([ScheduledStep(request, 0, 16, PRODUCER_BLOCKS)])
        producer.worker.save(first.saves)          # started: the Mamba slot copied, the put on its way
        written_by_vllm(lambda view: view.add_(1.0))  # vLLM's next step writes the slot in place
        second = producer.scheduler.build_meta([ScheduledStep(request, 16, 16, PRODUCER_BLOCKS)])
        producer.worker.save(second.saves)         # p-23 still saving: not waited on, both on their way
        saved_states = {name: {k: v.clone() for k, v in producer.worker.states(name, slot).items()}
                        for name in MAMBA}
        written_by_vllm(lambda view: view.add_(1.0))
        producer.worker.save(producer.scheduler.build_meta([ScheduledStep(request, 32, 8, PRODUCER_BLOCKS)]).saves)
        # ^ no save of p-23 in this step: its earlier ones are waited on, for the deadline, then the daemon is suspect
        third = producer.scheduler.build_meta([ScheduledStep(other, 0, 16, PRODUCER_BLOCKS)])
        producer.worker.save(third.saves)          # skipped at once
        delay_free, _ = producer.scheduler.request_finished(request)
        assert delay_free                           # vLLM keeps the blocks: the saves have not ended
        assert producer.worker.take_results({"p-23", "q-23"}).sent == {"q-23"}  # q-23's skipped save ended
        counted = producer.worker.counts.take()
        assert counted == {"deadline_misses.save": 1, "saves_skipped": 1}
    producer.worker.wait_idle()
    assert producer.worker.take_results().sent == {"p-23"}  # ended: now vLLM may free them
    # what was saved is the slot as it was when save() returned, not as vLLM wrote it after
    request = FakeRequest("c-23", prompt)
    assert ask(consumer.scheduler, request) == 32
    consumer.scheduler.after_alloc(request, CONSUMER_BLOCKS, 32)
    load(consumer, consumer.scheduler.build_meta([]).loads)
    assert consumer.worker.take_results().failed == set()
    for name in MAMBA:
        loaded = consumer.worker.states(name, CONSUMER_BLOCKS[0][0])
        assert all(torch.equal(loaded[k], saved_states[name][k]) for k in loaded)


def test_a_preempted_requests_saves_end_before_flush_returns(engines, daemon) -> None:
    producer = engines(role="producer", seed=24)  # the running daemon has all the time it needs
    prompt = tokens(24, 40)
    request = FakeRequest("p-24", prompt)
    producer.scheduler.after_alloc(request, PRODUCER_BLOCKS, 0)
    meta = producer.scheduler.build_meta([ScheduledStep(request, 0, 32, PRODUCER_BLOCKS)], preempted=["p-24", "x"])
    assert meta.preempted == ("p-24",)  # only requests with saves are flushed
    producer.worker.save(meta.saves)
    producer.worker.flush(meta.preempted)
    assert producer.worker.counts.take()["objects.save"] == 3  # 2 blocks + the Mamba group: ended
    # stopped: past the deadline flush drops the connection and returns once nothing more is
    # sent on it; vLLM then reuses the blocks, and what the daemon may hold is never those bytes
    producer = engines(role="producer", seed=24, deadline=DEADLINE)
    producer.worker.link.connected()
    other = FakeRequest("p-24b", tokens(25, 40))
    producer.scheduler.after_alloc(other, PRODUCER_BLOCKS, 0)
    meta = producer.scheduler.build_meta([ScheduledStep(other, 0, 16, PRODUCER_BLOCKS)], preempted=["p-24b"])
    block = PRODUCER_BLOCKS[1][0]
    before = {name: producer.buffers[name][block].clone() for name in ATTN}
    with stopped(daemon):
        producer.worker.save(meta.saves)
        producer.worker.flush(meta.preempted)
        for name in ATTN:
            producer.buffers[name][block].add_(1.0)  # the block, reused
        producer.worker.wait_idle()
        producer.worker.take_results()
    assert producer.worker.counts.take() == {"deadline_misses.flush": 1, "saves_failed": 1}
    consumer = engines(role="consumer", seed=None)
    request = FakeRequest("c-24b", tokens(25, 40))
    if ask(consumer.scheduler, request):  # the frame had reached the daemon's socket before it stopped
        consumer.scheduler.after_alloc(request, CONSUMER_BLOCKS, 16)
        load(consumer, consumer.scheduler.build_meta([]).loads)
        for name in ATTN:
            assert torch.equal(consumer.buffers[name][CONSUMER_BLOCKS[1][0]], before[name])


def test_the_clients_submitted_calls_never_wait_and_close_nowait_fails_them(daemon) -> None:
    """``Client.submit`` connects and calls without waiting; ``close_nowait`` fails what is
    pending (``ClientClosedError``) and, once its future is done, nothing more is sent."""
    with stopped(daemon):
        client = Client(daemon.url, use_shm=False)
        pending = client.submit("ping")           # the handshake itself goes unanswered
        assert not pending.done()
        refusing = client.close_nowait()
        refusing.result(timeout=30)
        with pytest.raises(ClientClosedError):
            pending.result(timeout=30)
        with pytest.raises(ClientClosedError):
            client.submit("ping")
    with Client(daemon.url, use_shm=False) as client:
        assert client.submit("ping").result(timeout=30) >= 0
        with pytest.raises(AttributeError):
            client.submit("_request")


def _thread_cpus(thread) -> frozenset[int]:
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        (line,) = [line for line in status if line.startswith("Cpus_allowed_list:")]
    return _cpu_ids(line.split(":", 1)[1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")
@pytest.mark.parametrize("openmp", ["", "first"])
def test_the_connectors_threads_leave_the_pinned_openmp_core(engines, daemon, monkeypatch, openmp) -> None:
    """vLLM's CPU worker pins its main thread to the first OpenMP core; the connector's client
    threads, started from it, run on the CPUs OpenMP was not bound to (all of them when none
    is free), never on the inherited pin."""
    first = min(os.sched_getaffinity(0))
    if openmp:
        monkeypatch.setenv("GOMP_CPU_AFFINITY", str(first))
    expected = connector_cpus()
    assert expected == ((_allowed_cpus() - {first} or _allowed_cpus()) if openmp else _allowed_cpus())
    seen: dict = {}

    def worker_main_thread() -> None:
        os.sched_setaffinity(0, {first})  # what libgomp does to vLLM's worker
        producer = engines(role="producer", seed=31)
        request = FakeRequest("p-pin", tokens(31, 40))
        prefill(producer, request, PRODUCER_BLOCKS)
        seen["main"] = _thread_cpus(threading.current_thread())
        client = producer.worker.link._client
        copy_threads = client._client._executor._threads  # started once a copy went off the loop
        seen.update({t.name: _thread_cpus(t) for t in [client._thread, *copy_threads]})

    pinned = threading.Thread(target=worker_main_thread)
    pinned.start()
    pinned.join()
    assert seen["main"] == {first}
    assert "statetier-client" in seen
    assert {name: cpus for name, cpus in seen.items() if name != "main"} == {
        name: expected for name in seen if name != "main"}
