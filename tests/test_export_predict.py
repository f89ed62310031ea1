"""Using a trained agent: adapter-only LoRA checkpoints, ``lightning-memrl export`` and ``predict``.

One LoRA fit of the tiny config through the real entry point (its base saved as a model folder, so
``from_pretrained`` can load it as a user's would), then the exported folder and the checkpoint.
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from helpers import quiet_trainer

from lightning_memrl import LoraSettings, MemoryR1Workflow, MemRLDataModule, MemRLModule, cli
from lightning_memrl.adapter_files import KEY, restore_frozen_base
from lightning_memrl.data.files import load_tasks
from lightning_memrl.errors import ConfigError, DataError
from lightning_memrl.export import export, load_trained_policy
from lightning_memrl.export import main as export_main
from lightning_memrl.models import build_tiny_model, build_tiny_tokenizer, load_policy

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "memagent" / "tiny.yaml")
LORA = "{r: 4, alpha: 8}"
DOCS = [  # one document with gold answers and chunks given, one without answers whose text is cut into chunks
    {"id": "d1", "question": "Where does Alice live?", "context": ["Alice lives in Paris.", "Bob likes tea."],
     "answers": ["Paris"]},
    {"id": "d2", "question": "What does Bob like?", "context": "Bob likes tea. " * 100},
]  # fmt: skip


def _cli(*args: str, cwd: Path) -> str:
    """Run the ``lightning-memrl`` entry point (``lightning_memrl.cli.main``) in this process; returns its stdout.

    In process: a subprocess per command would spend most of its time importing torch and Lightning again.
    """
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(out):
        patch.chdir(cwd)
        patch.setattr(sys, "argv", ["lightning-memrl", *args])
        cli.main()  # a user error would exit 2 here
    return out.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step LoRA fit on a saved tiny base, its adapter exported, and the agent run on two documents with it."""
    tmp = tmp_path_factory.mktemp("lora")
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, seed=0).save_pretrained(tmp / "base")
    tokenizer.save_pretrained(tmp / "base")
    base = str(tmp / "base")
    (tmp / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    ckpt = tmp / "logs" / "tiny" / "checkpoints" / "last.ckpt"
    _cli(
        "fit", "--config", TINY, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
        "--model.init_args.model_name_or_path", base, "--model.init_args.lora", LORA, cwd=tmp,
    )  # fmt: skip
    exported = _cli("export", str(ckpt), "adapter", cwd=tmp)
    predicted = _cli(
        "predict", "--config", TINY, "--model.init_args.model_name_or_path", "adapter",
        "--data.init_args.predict_path", "docs.jsonl", "--trainer.default_root_dir", "out",
        "--trainer.logger", "false", cwd=tmp,
    )  # fmt: skip
    return {"tmp": tmp, "base": base, "ckpt": ckpt, "adapter": tmp / "adapter", "stdout": exported + predicted}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_lora_checkpoint_holds_the_adapters_and_no_base_weights(run):
    from transformers import AutoModelForCausalLM

    ckpt = torch.load(run["ckpt"], map_location="cpu", weights_only=True)  # plain types: the CLI reads it so
    policy_keys = [k for k in ckpt["state_dict"] if k.startswith("policy.")]
    assert policy_keys and all(".lora_A." in k or ".lora_B." in k for k in policy_keys), policy_keys[:5]
    base_state = AutoModelForCausalLM.from_pretrained(run["base"]).state_dict()
    info = ckpt[KEY]
    assert info["base_model"] == run["base"] and len(info["dropped_keys"]) == len(base_state)
    base_bytes = sum(t.numel() * t.element_size() for t in base_state.values())
    assert run["ckpt"].stat().st_size < base_bytes  # the whole checkpoint is smaller than the base it leaves out


def test_export_cli_writes_a_peft_adapter_that_from_pretrained_loads(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert f"wrote the LoRA adapter of base {run['base']} and its tokenizer to adapter" in run["stdout"]
    files = {p.name for p in run["adapter"].iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files  # the adapter only
    assert json.loads((run["adapter"] / "adapter_config.json").read_text())["base_model_name_or_path"] == run["base"]
    ids = torch.tensor([AutoTokenizer.from_pretrained(run["adapter"])("Alice lives in Paris.")["input_ids"]])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run["base"]), run["adapter"])
    trained, _, _ = load_trained_policy(run["ckpt"])
    assert torch.allclose(_logits(loaded, ids), _logits(trained, ids), atol=1e-6)
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(run["base"]), ids)
    assert (_logits(loaded, ids) - base_logits).abs().max() > 1e-5  # the adapters trained: not the base


def test_merged_export_matches_the_lora_model(run, tmp_path):
    from transformers import AutoModelForCausalLM

    assert "merged" in export(run["ckpt"], tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in merged.state_dict())
    trained, tokenizer, _ = load_trained_policy(run["ckpt"])
    ids = torch.tensor([tokenizer("Bob likes tea. Where does Alice live?")["input_ids"]])
    diff = (_logits(merged, ids) - _logits(trained, ids)).abs().max()
    assert diff < 1e-5, diff


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predict_on_the_exported_folder_writes_memory_per_chunk_and_answer(run):
    assert f"wrote 2 predictions to {Path('out') / 'predictions.jsonl'}" in run["stdout"]
    rows = _rows(run["tmp"] / "out" / "predictions.jsonl")
    assert [r["id"] for r in rows] == ["d1", "d2"]
    assert rows[0]["chunks"] == DOCS[0]["context"] and len(rows[1]["chunks"]) == 4  # max_chunks 4 of the text
    assert rows[1]["chunks_dropped"] > 0
    for row in rows:
        assert len(row["memories"]) == len(row["chunks"]) and all(isinstance(m, str) for m in row["memories"])
        assert isinstance(row["completion"], str) and isinstance(row["answer"], str)
    assert rows[0]["answers"] == ["Paris"] and rows[0]["exact_match"] in (0.0, 1.0) and "f1" in rows[0]
    assert "answers" not in rows[1] and "exact_match" not in rows[1]


def test_predict_from_the_checkpoint_matches_the_exported_folder(run, tmp_path):
    """``predict --ckpt_path`` restores the adapters onto the re-loaded base and predicts what the export does."""
    hp = torch.load(run["ckpt"], map_location="cpu", weights_only=False)["hyper_parameters"]
    lora = hp["lora"]  # as given: the former name ``alpha``
    assert (lora["r"], lora["lora_alpha"] or lora["alpha"], lora["target_modules"]) == (4, 8, "all-linear")
    module = MemRLModule.load_from_checkpoint(run["ckpt"], weights_only=False)
    data = MemRLDataModule(predict_path=str(run["tmp"] / "docs.jsonl"), val_batch_size=4)
    trainer = quiet_trainer(tmp_path)
    trainer.predict(module, datamodule=data, ckpt_path=str(run["ckpt"]))  # the trainer's (strict) restore
    rows, expected = _rows(tmp_path / "predictions.jsonl"), _rows(run["tmp"] / "out" / "predictions.jsonl")
    keys = ("memories", "completion", "answer")
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in expected]


def test_adapter_only_checkpoint_refuses_another_base(run):
    checkpoint = torch.load(run["ckpt"], map_location="cpu", weights_only=False)
    tokenizer = build_tiny_tokenizer()
    other = load_policy("tiny", tokenizer, lora=LoraSettings(r=4, alpha=8), seed=1)  # same shapes, other weights
    with pytest.raises(ConfigError, match="loads with other weights now"):
        restore_frozen_base(checkpoint, torch.nn.ModuleDict({"policy": other}), str(run["ckpt"]))
    same = load_policy(run["base"], tokenizer, lora=LoraSettings(r=4, alpha=8))
    restore_frozen_base(checkpoint, torch.nn.ModuleDict({"policy": same}), str(run["ckpt"]))
    assert set(checkpoint["state_dict"]) >= {"policy." + k for k in same.state_dict()}


def test_export_refuses_a_missing_or_invalid_checkpoint_naming_it(tmp_path, capsys):
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    for name in ("missing.ckpt", "notes.ckpt"):
        with pytest.raises(SystemExit) as stop:
            export_main([str(tmp_path / name), str(tmp_path / "out")])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / name}: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_predict_documents_need_no_answers_but_rows_are_checked(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"question": "q?", "context": "text"}) + "\n" + json.dumps({"question": "q?"}) + "\n")
    with pytest.raises(DataError, match=r"row 1 \(line 2\): field 'context' is missing"):
        load_tasks(path, require_answers=False)
    path.write_text(json.dumps({"question": "q?", "context": "text", "answers": None}) + "\n")
    assert load_tasks(path, require_answers=False)[0].answers == []
    with pytest.raises(DataError, match="field 'answers' is missing"):
        load_tasks(path)  # training and validation still need answers
    with pytest.raises(ConfigError, match="predict needs --data.init_args.predict_path"):
        MemRLDataModule().setup("predict")


def test_predict_refuses_a_memory_bank_workflow_before_loading_a_model(tmp_path):
    (tmp_path / "docs.jsonl").write_text(json.dumps(DOCS[1]) + "\n")
    module = MemRLModule(workflow=MemoryR1Workflow())
    data = MemRLDataModule(predict_path=str(tmp_path / "docs.jsonl"))
    with pytest.raises(ConfigError, match="predict: MemoryR1Workflow builds its memory bank from LoCoMo"):
        quiet_trainer(tmp_path).predict(module, datamodule=data)
    assert module.policy is None
