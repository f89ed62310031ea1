"""examples/low_memory.yaml: checkpointed layers and a rollout without packed or merged copies, and it trains."""

from __future__ import annotations

from pathlib import Path

from helpers import parsed_cli, quiet_trainer

from lightning_memrl import RolloutEngine

REPO = Path(__file__).resolve().parents[1]


def test_low_memory_overlay_builds_and_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    configs = ["--config", str(REPO / "configs/memagent/tiny.yaml"), "--config", str(REPO / "examples/low_memory.yaml")]
    lora = ["--model.init_args.lora.r=4", "--model.init_args.lora.lora_alpha=8"]
    cli = parsed_cli([*configs, *lora, "--trainer.logger=false"])
    module = cli.model
    module.configure_model()
    engine = module.engine
    assert type(engine) is RolloutEngine and engine.packed is None and engine.merged is None
    layers = module.policy.get_base_model().model.layers
    assert all(layer.gradient_checkpointing for layer in layers)  # every decoder layer recomputed in backward
    quiet_trainer(tmp_path, steps=2).fit(module, cli.datamodule)
    assert module.global_step == 2
    assert 0 <= float(module.trainer.callback_metrics["train/logprob_gap"]) < 1e-3
