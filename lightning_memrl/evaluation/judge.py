"""LLM-as-a-judge through an OpenAI-compatible endpoint, as LoCoMo evaluations report J."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import httpx2

from lightning_memrl.errors import ConfigError, check_placeholders

log = logging.getLogger(__name__)

DEFAULT_JUDGE_PROMPT = (
    "Label an answer to a question about a long conversation as CORRECT or WRONG.\n"
    "Question: {question}\nGold answer: {gold}\nGenerated answer: {prediction}\n\n"
    "Be generous: the generated answer is CORRECT if it refers to the same thing or the same time as "
    'the gold answer, even when it is longer or worded differently. Reply with JSON: {{"label": "CORRECT"}} '
    'or {{"label": "WRONG"}}.'
)


Transport = Callable[[str, dict[str, str], dict[str, Any]], dict[str, Any]]
JudgeItem = tuple[str, list[str], str]  # (question, gold answers, prediction)

RETRIED_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})  # as the openai client retries
MAX_RETRY_WAIT = 60.0  # seconds: the longest wait between two attempts, whatever Retry-After says


class JudgeError(RuntimeError):
    """A judge request that failed for good; the message names the endpoint, the attempts and the last error."""


_SECRET_PARAM = re.compile(r"key|token|secret|passw|pwd|auth|credential|signature|^sig$", re.IGNORECASE)


def check_url_has_no_credentials(url: str, option: str, api_key_env: str) -> None:
    """Raise a ConfigError when ``url`` carries a user, password or key-like query parameter.

    A URL is written into ``config.yaml``, ``hparams.yaml`` and checkpoints, so a key in it would
    leak; keys come only from the environment. The message never repeats the secret.
    """
    parts = urllib.parse.urlsplit(url)
    found = []
    if parts.username is not None or parts.password is not None:
        found.append("a user name or password before '@'")
    found += [
        f"the query parameter '{name}'"
        for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if _SECRET_PARAM.search(name)
    ]
    if found:
        safe = urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
        raise ConfigError(
            f"{option} carries a credential ({', '.join(found)}); it would be saved in config.yaml, hparams.yaml "
            f"and checkpoints. Remove it from the URL (e.g. {safe}) and put the key in the environment variable "
            f"{api_key_env}, not in base_url."
        )


def _retry_after(response: httpx2.Response) -> float | None:
    """Seconds the server asked to wait (``Retry-After`` in seconds), or None."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


def post_with_retries(
    client: httpx2.Client, url: str, headers: dict[str, str], payload: dict[str, Any], max_retries: int, backoff: float
) -> dict[str, Any]:
    """POST ``payload`` as JSON and return the reply's JSON, retrying what may pass on a second try.

    A connection error, a timeout and the statuses of :data:`RETRIED_STATUSES` (rate limit, overload) are
    retried up to ``max_retries`` times, waiting ``backoff * 2**attempt`` seconds (or the server's
    ``Retry-After``, at most :data:`MAX_RETRY_WAIT`). Any other 4xx status fails at once.

    Raises:
        JudgeError: naming ``url``, the number of attempts and the last error.
    """
    last = ""
    for attempt in range(max_retries + 1):
        wait = None
        try:
            response = client.post(url, json=payload, headers=headers)
        except httpx2.TransportError as err:  # refused, reset, timed out
            last = f"{type(err).__name__}: {err}"
        else:
            if response.is_success:
                return response.json()
            last = f"HTTP {response.status_code}: {response.text[:200]!r}"
            if response.status_code not in RETRIED_STATUSES:
                raise JudgeError(
                    f"LLM judge endpoint {url} answered {last}; not retried (check the judge's base_url, model "
                    "and the API key in its api_key_env)"
                )
            wait = _retry_after(response)
        if attempt < max_retries:
            time.sleep(min(MAX_RETRY_WAIT, backoff * 2**attempt if wait is None else wait))
    raise JudgeError(f"LLM judge endpoint {url} failed on all {max_retries + 1} attempts; last error: {last}")


class LLMJudge:
    """LLM-as-judge over an OpenAI-compatible ``/chat/completions`` endpoint (used only when configured).

    Requests go through ``httpx2`` (the HTTP client of ``huggingface_hub``) with a timeout, retries with
    exponential backoff on rate limits, overloads and dropped connections, and ``max_workers`` requests
    in flight at once for a batch (:meth:`judge_many`, :meth:`prefetch`).

    Args:
        base_url: endpoint root, e.g. ``http://localhost:8000/v1``. It must not carry a credential
            (``user:key@`` or a query parameter such as ``?api_key=``): it is saved with the config
            and in checkpoints, so such a URL is refused with a :class:`ConfigError`.
        model: model name sent in the request.
        api_key_env: environment variable holding the API key (unset: no Authorization header); the
            only place a key is read from.
        prompt: template with ``{question}``, ``{gold}``, ``{prediction}``.
        timeout: seconds per request (connect, read and write each).
        max_retries: further attempts after a failed one (0: none).
        backoff: seconds before the first retry, doubled for each next one.
        max_workers: requests in flight at once when a batch is judged.
        transport: ``(url, headers, payload) -> response JSON`` replacing the HTTP client (no retries);
            tests pass a fake one.

    Calling it returns 1.0 (CORRECT), 0.0 (WRONG) or None when the call or its reply failed
    (counted in ``failures`` and logged with the endpoint, never raised).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        prompt: str = DEFAULT_JUDGE_PROMPT,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        max_workers: int = 4,
        transport: Transport | None = None,
    ) -> None:
        check_placeholders(("prompt", prompt, ("{question}", "{gold}", "{prediction}")), owner="LLMJudge")
        check_url_has_no_credentials(base_url, "LLMJudge base_url", api_key_env)
        for name, value in (("timeout", timeout), ("backoff", backoff), ("max_retries", max_retries)):
            if value < 0:
                raise ConfigError(f"LLMJudge {name} must be >= 0 (got {value})")
        if max_workers < 1:
            raise ConfigError(f"LLMJudge max_workers must be >= 1 (got {max_workers})")
        parts = urllib.parse.urlsplit(base_url)  # the path gets /chat/completions; a query (?api-version=) stays
        self.url = urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/chat/completions"))
        self.model, self.api_key_env, self.prompt, self.timeout = model, api_key_env, prompt, timeout
        self.max_retries, self.backoff, self.max_workers = max_retries, backoff, max_workers
        self.transport = transport
        self.calls = 0
        self.failures = 0
        self._lock = threading.Lock()
        self._ready: dict[tuple[str, tuple[str, ...], str], float | None] = {}  # verdicts of the last prefetch

    def __call__(self, question: str, gold: list[str], prediction: str) -> float | None:
        key = (question, tuple(gold), prediction)
        if key in self._ready:
            return self._ready[key]
        with self._client() as client:
            return self._judge(client, question, gold, prediction)

    def judge_many(self, items: Sequence[JudgeItem]) -> list[float | None]:
        """Verdicts of ``(question, gold, prediction)`` items, ``max_workers`` requests at a time, in order."""
        if not items:
            return []
        with self._client() as client, ThreadPoolExecutor(min(self.max_workers, len(items))) as pool:
            return list(pool.map(lambda item: self._judge(client, *item), items))

    def prefetch(self, items: Sequence[JudgeItem]) -> None:
        """Judge a batch concurrently; calling the judge on one of its items then returns the kept verdict."""
        verdicts = self.judge_many(items)
        self._ready = {(q, tuple(gold), pred): v for (q, gold, pred), v in zip(items, verdicts)}

    def __getstate__(self) -> dict[str, Any]:  # saved with the hyper-parameters: no lock, no kept verdicts
        state = dict(self.__dict__)
        state.pop("_lock")
        state["_ready"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _client(self) -> Any:
        return nullcontext() if self.transport is not None else httpx2.Client(timeout=self.timeout)

    def request(self, client: httpx2.Client | None, payload: dict[str, Any]) -> dict[str, Any]:
        """One chat-completions request (with retries) and its reply's JSON; :class:`JudgeError` when it fails."""
        headers = {"Content-Type": "application/json"}
        if os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        if self.transport is not None:
            return self.transport(self.url, headers, payload)
        if client is None:
            raise ValueError("LLMJudge.request needs an httpx2.Client when no transport is set")
        return post_with_retries(client, self.url, headers, payload, self.max_retries, self.backoff)

    def _judge(self, client: httpx2.Client | None, question: str, gold: list[str], prediction: str) -> float | None:
        with self._lock:
            self.calls += 1
            call = self.calls
        content = self.prompt.format(question=question, gold=" / ".join(gold), prediction=prediction)
        payload = {"model": self.model, "temperature": 0, "messages": [{"role": "user", "content": content}]}
        try:
            reply = str(self.request(client, payload)["choices"][0]["message"]["content"])
        except JudgeError as err:  # its message names the endpoint
            return self._failed(f"LLM judge call {call} failed: {err}")
        except Exception as err:  # network or reply-shape errors: count, do not crash evaluation
            return self._failed(f"LLM judge call {call} to {self.url} failed: {type(err).__name__}: {err}")
        label = re.search(r"\b(CORRECT|WRONG)\b", reply.upper())
        if label is None:
            return self._failed(f"LLM judge reply from {self.url} has no CORRECT/WRONG label: {reply[:80]!r}")
        return 1.0 if label.group(1) == "CORRECT" else 0.0

    def _failed(self, message: str) -> None:
        with self._lock:
            self.failures += 1
            failures = self.failures
        log.warning("%s (%d failures so far)", message, failures)
        return None
