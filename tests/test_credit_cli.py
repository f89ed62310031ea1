"""Every credit method's YAML in examples/credit/ runs two steps of configs/memagent/tiny.yaml through the CLI.

A YAML there is an overlay on the tiny config; its header names what the method logs with a line
``# logs: train/<method>/<metric>`` (one or more), and the run must log each of them.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from test_cli import REPO, TINY, _cli, _logs, _ok

CREDIT_EXAMPLES = sorted((REPO / "examples" / "credit").glob("*.yaml"))


def _logged_metrics(path: Path) -> list[str]:
    return re.findall(r"^# logs: (\S+)", path.read_text(), flags=re.MULTILINE)


@pytest.mark.parametrize("overlay", CREDIT_EXAMPLES, ids=lambda p: p.stem)
def test_credit_method_runs_two_steps_from_yaml(tmp_path: Path, overlay: Path) -> None:
    expected = _logged_metrics(overlay)
    assert expected, f"{overlay.name}: name what the method logs in a '# logs: train/...' header line"
    args = ["fit", "--config", TINY, "--config", str(overlay), "--trainer.max_steps", "2"]
    _ok(_cli(*args, "--trainer.num_sanity_val_steps", "0", cwd=tmp_path, extra_path=str(REPO / "examples")))
    (metrics,) = (_logs(tmp_path) / "csv").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(open(metrics)))
    steps = {r["step"] for r in rows if r.get("train/reward")}
    assert len(steps) == 2
    for name in expected:
        assert any(r.get(name) not in (None, "") for r in rows), f"{overlay.name}: {name} was not logged"
