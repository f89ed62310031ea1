"""The LLM judge over real HTTP: retries with backoff, one clear error naming the endpoint, concurrent batches."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2
import pytest

from lightning_memrl.evaluation.judge import JudgeError, LLMJudge

Reply = Callable[[int, str], tuple[int, dict]]  # (request number from 1, prompt) -> (status, JSON body)


def verdict(label: str) -> tuple[int, dict]:
    return 200, {"choices": [{"message": {"content": json.dumps({"label": label})}}]}


@contextmanager
def judge_server(reply: Reply) -> Iterator[tuple[str, list[str]]]:
    """A local OpenAI-compatible endpoint answering with ``reply``; yields its base URL and the prompts it got."""
    prompts: list[str] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][0]["content"] if body["messages"] else ""
            with lock:
                prompts.append(prompt)
                number = len(prompts)
            status, answer = reply(number, prompt)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1", prompts
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_judge_retries_an_overloaded_endpoint_then_succeeds():
    def reply(number, prompt):  # 503, 429, then the verdict
        return {1: (503, {"error": "overloaded"}), 2: (429, {"error": "slow down"})}.get(number, verdict("CORRECT"))

    with judge_server(reply) as (url, prompts):
        judge = LLMJudge(url, "judge-model", max_retries=3, backoff=0.01)
        assert judge("Where did Ben move?", ["Lisbon"], "to Lisbon") == 1.0
    assert len(prompts) == 3 and (judge.calls, judge.failures) == (1, 0)
    assert "Generated answer: to Lisbon" in prompts[-1]


def test_an_endpoint_that_always_fails_gives_one_error_naming_it(caplog):
    with judge_server(lambda number, prompt: (500, {"error": "down"})) as (url, prompts):
        judge = LLMJudge(url, "judge-model", max_retries=2, backoff=0.01)
        with caplog.at_level(logging.WARNING, logger="lightning_memrl.evaluation.judge"):
            assert judge("q", ["a"], "b") is None  # evaluation goes on without a verdict
        with httpx2.Client() as client, pytest.raises(JudgeError) as raised:
            judge.request(client, {"model": "judge-model", "messages": []})
    endpoint = f"{url}/chat/completions"
    assert str(raised.value).startswith(f"LLM judge endpoint {endpoint} failed on all 3 attempts")
    assert "HTTP 500" in str(raised.value)
    assert len(prompts) == 3 + 3 and judge.failures == 1
    assert f"LLM judge call 1 failed: LLM judge endpoint {endpoint} failed on all 3 attempts" in caplog.text


def test_a_refused_key_is_not_retried():
    with judge_server(lambda number, prompt: (401, {"error": "bad key"})) as (url, prompts):
        judge = LLMJudge(url, "m", max_retries=3, backoff=0.01)
        with httpx2.Client() as client, pytest.raises(JudgeError, match="answered HTTP 401.*not retried"):
            judge.request(client, {"model": "m", "messages": []})
    assert len(prompts) == 1


def test_nothing_listening_is_retried_then_named():
    with judge_server(lambda number, prompt: verdict("WRONG")) as (url, _):
        pass  # the server is gone: connections are refused
    judge = LLMJudge(url, "m", max_retries=1, backoff=0.01, timeout=2.0)
    with httpx2.Client(timeout=2.0) as client, pytest.raises(JudgeError, match="failed on all 2 attempts.*Connect"):
        judge.request(client, {"model": "m", "messages": []})


def test_a_batch_is_judged_concurrently_and_its_verdicts_are_kept():
    barrier = threading.Barrier(4, timeout=20)  # passes only when 4 requests are in flight at once

    def reply(number, prompt):
        barrier.wait()
        return verdict("CORRECT" if "Generated answer: yes" in prompt else "WRONG")

    items = [(f"q{i}", ["yes"], "yes" if i % 2 == 0 else "no") for i in range(4)]
    with judge_server(reply) as (url, prompts):
        judge = LLMJudge(url, "m", max_workers=4, backoff=0.01)
        judge.prefetch(items)
        assert [judge(*item) for item in items] == [1.0, 0.0, 1.0, 0.0]  # kept: no further request
    assert len(prompts) == 4 and (judge.calls, judge.failures) == (4, 0)


def test_the_judge_pickles_and_copies_with_the_hyper_parameters():
    judge = LLMJudge("http://judge.local/v1", "m", max_workers=2)
    judge._ready = {("q", ("a",), "a"): 1.0}
    for clone in (copy.deepcopy(judge), pickle.loads(pickle.dumps(judge))):
        assert (clone.url, clone.max_workers, clone._ready) == (judge.url, 2, {})
        with clone._lock:  # a fresh lock
            pass


@pytest.mark.parametrize(
    ("option", "value"), [("max_workers", 0), ("max_retries", -1), ("timeout", -1.0), ("backoff", -0.5)]
)
def test_judge_options_are_checked(option, value):
    with pytest.raises(ValueError, match=f"LLMJudge {option} must be >= "):
        LLMJudge("http://judge.local/v1", "m", **{option: value})


def test_a_bank_workflow_judges_an_evaluation_batch_before_scoring_each():
    from lightning_memrl.types import Task, Trajectory
    from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow

    trajectories = [
        Trajectory(task=Task(question=f"q{i}", context=["c"], answers=["Lisbon"], id=f"t{i}"), info={"answer": a})
        for i, a in enumerate(["Lisbon", "Paris", "Lisbon"])
    ]
    reply = lambda number, prompt: verdict("CORRECT" if "Generated answer: Lisbon" in prompt else "WRONG")  # noqa: E731
    with judge_server(reply) as (url, prompts):
        workflow = MemoryR1Workflow(judge=LLMJudge(url, "m", max_workers=3))
        workflow.prepare_evaluation(trajectories)
        assert len(prompts) == 3
        assert [workflow.evaluation_metrics(t)["judge"] for t in trajectories] == [1.0, 0.0, 1.0]
    assert len(prompts) == 3  # the verdicts were kept, not asked again
