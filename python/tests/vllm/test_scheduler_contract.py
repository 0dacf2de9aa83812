"""The connector's scheduler side inside the installed vLLM's own Scheduler, with no model.

test_connector.py runs the whole connector in vLLM's CPU build, which is published only up to
0.32. These tests need nothing but vLLM's Python sources: the installed release's real
Scheduler (vllm.v1.core.sched.scheduler) schedules requests with KvtierConnector's scheduler
side against a real `kvtier serve` (kvtier.vllm.model_free, which plays vLLM's model runner and
kvtier's workers: the chunks each step saves are stored and those it loads read back and
checked). So they also run on the releases that cannot serve a model here (0.33 and 0.34:
docs/vllm.md, "Supported vLLM versions"). What is checked is the contract between the two
schedulers: what vLLM asks and when, what kvtier answers, and that vLLM's books balance after
every fault.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvtier.vllm.model_free import ModelFreeEngine  # noqa: E402

from conftest import KvtierServer, random_prompt  # noqa: E402

CHUNK = 256  # kvtier's default chunk_tokens


class Engine(ModelFreeEngine):
    """The tiny test model's shape, KvtierConnector in server mode, loads between steps."""

    def __init__(self, workdir: Path, server: KvtierServer, **kwargs):
        super().__init__(workdir / "model", server.socket, {"kvtier.load_mode": "async"},
                         **kwargs)


@pytest.fixture
def server(workdir: Path, tmp_path: Path):
    work = tmp_path / "serve"
    work.mkdir()
    (work / "model").symlink_to(workdir / "model")
    s = KvtierServer(work, None)
    yield s
    s.proc.send_signal(signal.SIGCONT)
    s.stop()


@pytest.fixture
def engine(workdir: Path, server):
    e = Engine(workdir, server)
    yield e
    e.close()


def computed_when_scheduled(engine: Engine, req_id: str) -> int:
    """Steps until the request is scheduled (for at most 30 s: a lookup vLLM is told to ask
    again about takes steps, not a fixed number); then the tokens it starts from."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = engine.step()
        if req_id in out.num_scheduled_tokens:
            request = engine.scheduler.requests[req_id]
            return request.num_computed_tokens - out.num_scheduled_tokens[req_id]
    raise AssertionError(f"{req_id} was never scheduled")


PREFIX = random_prompt(7, 2 * CHUNK)


def stored_prefix(engine: Engine) -> list[bytes]:
    """Serves PREFIX + 100 tokens once, so that kvtier holds its two chunks; then empties
    vLLM's own prefix cache, so that a later hit can only come from kvtier."""
    engine.add("first", PREFIX + random_prompt(8, 100))
    engine.drain()
    keys = saved_by(engine, "first")
    assert len(keys) == 2, "the first request's two full chunks are saved"
    engine.reset_prefix_cache()
    return keys


def test_a_saved_prefix_comes_back_as_a_load(engine: Engine):
    keys = stored_prefix(engine)
    engine.add("again", PREFIX + random_prompt(9, 100))
    assert computed_when_scheduled(engine, "again") == 2 * CHUNK
    assert [job.keys for job in engine.loads] == [keys], "one load of the two stored chunks"
    engine.drain()
    # vLLM's own cache now holds the prefix: served by it, neither loaded nor saved again.
    engine.add("third", PREFIX + random_prompt(10, 100))
    assert computed_when_scheduled(engine, "third") == 2 * CHUNK
    engine.drain()
    assert len(engine.loads) == 1
    assert not set(saved_by(engine, "third")) & set(keys)


def saved_by(engine: Engine, req_id: str) -> list[bytes]:
    return [k for job in engine.saves if job.req_id == req_id for k in job.keys]


def test_a_request_aborted_during_its_load(engine: Engine):
    stored_prefix(engine)
    engine.add("aborted", PREFIX + random_prompt(9, 100))
    engine.run(lambda: len(engine.loads) == 1)
    # The load was handed out in the step just run and reported done on its output; the abort
    # comes before vLLM has seen that report (the next schedule()).
    engine.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    engine.drain()
    # A second request for the same prefix after the abort: served, vLLM's books balance.
    engine.reset_prefix_cache()
    engine.add("after", PREFIX + random_prompt(11, 100))
    engine.drain()
    assert engine.finished("after")


def test_a_request_aborted_while_its_load_is_under_way(engine: Engine):
    """The abort comes while the workers still read: vLLM keeps the request's blocks until the
    workers report the load's end, then frees them once."""
    stored_prefix(engine)
    engine.hold_loads = True
    engine.add("aborted", PREFIX + random_prompt(9, 100))
    engine.run(lambda: len(engine.loads) == 1)
    engine.step()  # a step with the load still under way
    engine.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    engine.step()
    engine.release_loads()
    engine.drain()
    engine.hold_loads = False
    engine.reset_prefix_cache()
    engine.add("after", PREFIX + random_prompt(11, 100))
    engine.drain()
    assert engine.finished("after")


def test_an_abort_before_the_load_is_handed_out(engine: Engine):
    stored_prefix(engine)
    engine.add("aborted", PREFIX + random_prompt(9, 100))
    engine.scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    engine.drain()
    assert not engine.loads


def test_a_failed_load_is_recomputed_once_and_saved_again(engine: Engine):
    keys = stored_prefix(engine)
    engine.fail_loads = True
    engine.add("failed", PREFIX + random_prompt(9, 100))
    start = computed_when_scheduled(engine, "failed")
    engine.fail_loads = False
    engine.drain()
    assert start == 0, "the failed chunks are recomputed"
    assert len(engine.loads) == 1, "a failed load is not tried again"
    # Recomputed chunks are saved again (the store had lost them, as far as vLLM knows).
    assert saved_by(engine, "failed")[:2] == keys


def test_a_stalled_server_defers_lookups_without_holding_the_loop(engine: Engine, server):
    stored_prefix(engine)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        engine.schedule_s.clear()
        engine.add("stalled", PREFIX + random_prompt(9, 100))
        # The lookup cannot be answered: vLLM is told to ask again, step after step, until the
        # lookup's RPC timeout (1 s) makes it a miss and the request is computed without kvtier.
        start = computed_when_scheduled(engine, "stalled")
        waited = list(engine.schedule_s)
        assert start == 0
        engine.drain()
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert not engine.loads
    # A loop that waited for the lookup would have spent the second in one step. Deferred, it
    # takes many short steps (a few milliseconds each); their median tells that apart however
    # long a loaded machine deschedules one of them.
    median = sorted(waited)[len(waited) // 2]
    assert len(waited) >= 10 and median < 0.05, (len(waited), median, max(waited))


def test_a_dead_server_means_recompute(engine: Engine, server):
    stored_prefix(engine)
    server.kill()
    engine.add("dead", PREFIX + random_prompt(9, 100))
    assert computed_when_scheduled(engine, "dead") == 0
    engine.drain()
    assert not engine.loads


def test_a_preempted_request_resumes_through_a_load(workdir: Path, server):
    """Two requests whose prompts fit vLLM's KV cache together but whose answers do not: vLLM
    preempts one, the other's answer takes its blocks, and the preempted one resumes with its
    saved chunk loaded from kvtier rather than recomputed."""
    # 38 usable blocks of 16 tokens: two 288-token prompts (18 blocks each) fit, and either
    # answer alone grows to 37 blocks.
    engine = Engine(workdir, server, num_blocks=39)
    try:
        engine.add("a", random_prompt(20, 288), max_tokens=300)
        engine.add("b", random_prompt(21, 288), max_tokens=300)
        engine.run(lambda: engine.idle(), max_steps=2000)
        assert engine.finished("a") and engine.finished("b")
        assert engine.side.resumed_from_kvtier >= 1, engine.loads
        assert engine.loads and all(len(job.keys) >= 1 for job in engine.loads)
    finally:
        engine.close()


def test_the_scheduler_cost_benchmark_measures_both_arms(capsys):
    """kvtier.bench.scheduler_cost end to end, small: both arms serve every turn, every turn is
    looked up, and vLLM's own hits are not saved again; a bad flag is refused."""
    from kvtier.bench import scheduler_cost

    assert scheduler_cost.main(["--context", "2048", "--users", "2", "--rounds", "3",
                                "--system", "300", "--question", "50", "--answer", "20",
                                "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for arm in r["arms"].values():
        assert arm["requests"] == 6 and arm["steps"] >= 3 * 20
        assert 0 < arm["step_us_p50"] <= arm["step_us_p99"]
    assert r["lookups"] >= 6 and r["saves_skipped"] > 0
    with pytest.raises(SystemExit):
        scheduler_cost.main(["--context", "100"])  # shorter than its turns
    assert "--context is shorter" in capsys.readouterr().err
