"""configs/memory_r1/locomo.yaml and configs/rmm/locomo.yaml end to end through ``lightning-memrl``.

The tiny random model and a tiny LoCoMo fixture replace SmolLM2 and the real data on the command line.
"""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch
from locomo_fixture import write_locomo, write_two_conversations
from test_cli import REPO, _cli, _ok

TINY_MODEL = [
    "--model.init_args.model_name_or_path",
    "tiny",
    "--model.init_args.lora",
    "null",
    "--model.init_args.dtype",
    "float32",
    "--trainer.max_steps",
    "1",
    "--trainer.val_check_interval",
    "1",
    "--model.init_args.generation.max_new_tokens",
    "8",
]


@pytest.mark.parametrize(
    "config, workflow_args",
    [
        ("memory_r1_locomo", ["--model.init_args.workflow.init_args.extract_max_tokens", "24"]),
        ("rmm_locomo", ["--model.init_args.workflow.init_args.reflect_max_tokens", "24"]),
    ],
)
def test_config_fits_and_validates_with_the_tiny_model(tmp_path, config, workflow_args):
    write_two_conversations(tmp_path / "data")  # the last conversation (conv-b) validates, conv-a trains
    path = str(REPO / "configs" / config.removesuffix("_locomo") / "locomo.yaml")
    args = ["--config", path, "--data.init_args.locomo_path", str(tmp_path / "data"), *TINY_MODEL, *workflow_args]
    proc = _ok(_cli("fit", *args, cwd=tmp_path))
    assert "train on 1 conversations ['conv-a'] (3 questions), validate on 1 ['conv-b'] (3 questions)" in proc.stderr
    logs = tmp_path / "logs" / config
    rows = list(csv.DictReader(open(next((logs / "csv").glob("version_*/metrics.csv")))))
    assert len([r for r in rows if r.get("train/reward")]) == 1
    (report_path,) = list(logs.glob("csv/version_*/eval_report_step1.json"))
    report = json.loads(report_path.read_text())
    assert report["overall"]["tasks"] == 3  # no category 5; max_sessions 2 drops the question about session 3
    assert set(report["by_category"]) == {"2", "4"}
    assert "evidence_recall" in report["overall"] and "bleu1" in report["overall"]
    predictions = report_path.with_name("eval_predictions_step1.jsonl").read_text().splitlines()
    assert {json.loads(line)["id"].split(":")[0] for line in predictions} == {"conv-b"}  # held apart
    ckpt = torch.load(logs / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 1 and "counters" in ckpt["memrl_workflow"]
    if config == "rmm_locomo":  # the reranker and the frozen reflection's bank are checkpointed and restored
        assert "workflow_modules.reranker.query_adapter.weight" in ckpt["state_dict"]
        assert set(ckpt["memrl_workflow"]["banks"]) == {"conv-a"}  # saved after the step, before validation
        proc = _ok(_cli("validate", *args, "--ckpt_path", str(logs / "checkpoints" / "last.ckpt"), cwd=tmp_path))
        assert "category" in proc.stdout and "evidence_recall" in proc.stdout


def test_config_validating_on_its_training_questions_is_refused(tmp_path):
    data = write_locomo(tmp_path / "data")
    path = str(REPO / "configs" / "memory_r1" / "locomo.yaml")
    args = ["--config", path, "--data.init_args.locomo_path", str(data), *TINY_MODEL]
    proc = _cli("fit", *args, "--data.init_args.locomo_val_conversations", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "train and validation tasks overlap: 3 of 3 validation tasks are training tasks" in proc.stderr
    assert "'conv-test:qa0', 'conv-test:qa1', 'conv-test:qa2'" in proc.stderr
    proc = _cli("fit", *args, cwd=tmp_path)  # one conversation cannot be split
    assert proc.returncode == 2 and "needs at least 2 conversations" in proc.stderr


def test_memory_workflow_without_locomo_data_says_what_to_set(tmp_path):
    proc = _cli("fit", "--config", str(REPO / "configs" / "memory_r1" / "locomo.yaml"), *TINY_MODEL, cwd=tmp_path)
    assert proc.returncode != 0
    assert "--data.init_args.locomo_path" in proc.stderr


def test_configs_have_no_local_paths():
    data = (REPO / "configs" / "shared" / "locomo_data.yaml").read_text()
    assert "locomo_path: null" in data  # the user sets the data path
    for config in ("memory_r1", "rmm"):
        assert "data: ../shared/locomo_data.yaml" in (REPO / "configs" / config / "locomo.yaml").read_text()
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        text = path.read_text()
        assert not re.search(r":\s*['\"]?/", text), f"{path.name}: absolute paths do not belong in a config"
        for line in text.splitlines():  # a comment on every key that holds a value
            if line.strip() and not line.strip().startswith("#") and not line.rstrip().endswith(":"):
                assert "#" in line, f"{path.relative_to(REPO)}: no comment on {line.strip()!r}"
