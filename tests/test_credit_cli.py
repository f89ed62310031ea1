"""Every credit method's YAML in examples/credit/ runs two steps of configs/memagent/tiny.yaml through the CLI.

A YAML there is an overlay on the tiny config; its header names what the method logs with a line
``# logs: train/<method>/<metric>`` (one or more), and the run must log each of them. The runs call
the ``lightning-memrl`` entry point (``lightning_memrl.cli.main``) in this process: a subprocess per
method would spend most of its time importing torch and Lightning again.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest
from test_cli import REPO, TINY, _logs

from lightning_memrl import cli

CREDIT_EXAMPLES = sorted((REPO / "examples" / "credit").glob("*.yaml"))


def _logged_metrics(path: Path) -> list[str]:
    return re.findall(r"^# logs: (\S+)", path.read_text(), flags=re.MULTILINE)


@pytest.mark.parametrize("overlay", CREDIT_EXAMPLES, ids=lambda p: p.stem)
def test_credit_method_runs_two_steps_from_yaml(tmp_path: Path, monkeypatch, overlay: Path) -> None:
    expected = _logged_metrics(overlay)
    assert expected, f"{overlay.name}: name what the method logs in a '# logs: train/...' header line"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    args = [
        "--config",
        TINY,
        "--config",
        str(overlay),
        "--trainer.max_steps",
        "2",
        "--trainer.num_sanity_val_steps",
        "0",
    ]
    monkeypatch.setattr(sys, "argv", ["lightning-memrl", "fit", *args])
    cli.main()  # a user error would exit 2 here
    (metrics,) = (_logs(tmp_path) / "csv").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(open(metrics)))
    assert len({r["step"] for r in rows if r.get("train/reward")}) == 2
    for name in expected:
        assert any(r.get(name) not in (None, "") for r in rows), f"{overlay.name}: {name} was not logged"
