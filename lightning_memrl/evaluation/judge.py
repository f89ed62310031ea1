"""LLM-as-a-judge through an OpenAI-compatible endpoint, as LoCoMo evaluations report J."""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

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


def _http_post(url: str, headers: dict[str, str], payload: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - user-configured endpoint
        return json.loads(response.read().decode())


class LLMJudge:
    """LLM-as-judge over an OpenAI-compatible ``/chat/completions`` endpoint (used only when configured).

    Args:
        base_url: endpoint root, e.g. ``http://localhost:8000/v1``. It must not carry a credential
            (``user:key@`` or a query parameter such as ``?api_key=``): it is saved with the config
            and in checkpoints, so such a URL is refused with a :class:`ConfigError`.
        model: model name sent in the request.
        api_key_env: environment variable holding the API key (unset: no Authorization header); the
            only place a key is read from.
        prompt: template with ``{question}``, ``{gold}``, ``{prediction}``.
        timeout: seconds per request.
        transport: ``(url, headers, payload) -> response JSON``; default: an HTTP POST. Tests
            pass a fake one.

    Calling it returns 1.0 (CORRECT), 0.0 (WRONG) or None when the call or its reply failed
    (counted in ``failures`` and logged, never raised).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        prompt: str = DEFAULT_JUDGE_PROMPT,
        timeout: float = 60.0,
        transport: Transport | None = None,
    ) -> None:
        check_placeholders(("prompt", prompt, ("{question}", "{gold}", "{prediction}")), owner="LLMJudge")
        check_url_has_no_credentials(base_url, "LLMJudge base_url", api_key_env)
        parts = urllib.parse.urlsplit(base_url)  # the path gets /chat/completions; a query (?api-version=) stays
        self.url = urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/chat/completions"))
        self.model, self.api_key_env, self.prompt, self.timeout = model, api_key_env, prompt, timeout
        self.transport = transport
        self.calls = 0
        self.failures = 0

    def __call__(self, question: str, gold: list[str], prediction: str) -> float | None:
        self.calls += 1
        payload = {
            "model": self.model,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": self.prompt.format(question=question, gold=" / ".join(gold), prediction=prediction),
                }
            ],
        }
        headers = {"Content-Type": "application/json"}
        if os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        try:
            if self.transport is not None:
                response = self.transport(self.url, headers, payload)
            else:
                response = _http_post(self.url, headers, payload, self.timeout)
            reply = str(response["choices"][0]["message"]["content"])
        except Exception as err:  # network, HTTP or reply-shape errors: count, do not crash evaluation
            self.failures += 1
            log.warning("LLM judge call %d failed (%d failures so far): %s", self.calls, self.failures, err)
            return None
        label = re.search(r"\b(CORRECT|WRONG)\b", reply.upper())
        if label is None:
            self.failures += 1
            log.warning("LLM judge reply has no CORRECT/WRONG label: %.80r", reply)
            return None
        return 1.0 if label.group(1) == "CORRECT" else 0.0
