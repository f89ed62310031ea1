"""Option values that would silently break learning stop at parse time, naming the option and its range."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memrl import (
    ConfigError,
    GenerationSettings,
    GRPOSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
)
from lightning_memrl.errors import check_option, find_user_error

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "memagent" / "tiny.yaml")

BAD = [
    (GRPOSettings, {"group_size": 1}, "model.init_args.grpo.group_size must be >= 2 (got 1): GRPO's advantage"),
    (GRPOSettings, {"clip_low": -0.1}, "model.init_args.grpo.clip_low must be in [0.0, 1.0) (got -0.1)"),
    (GRPOSettings, {"clip_low": 1.0}, "model.init_args.grpo.clip_low must be in [0.0, 1.0) (got 1.0)"),
    (GRPOSettings, {"kl_coef": -0.01}, "model.init_args.grpo.kl_coef must be >= 0.0 (got -0.01)"),
    (GRPOSettings, {"dual_clip": 1.0}, "model.init_args.grpo.dual_clip must be > 1.0 (got 1.0)"),
    (GRPOSettings, {"ppo_epochs": 0}, "model.init_args.grpo.ppo_epochs must be >= 1 (got 0)"),
    (GRPOSettings, {"max_grad_norm": float("nan")}, "model.init_args.grpo.max_grad_norm must be >= 0.0 (got nan)"),
    (GRPOSettings, {"max_consecutive_skipped_steps": 0}, "grpo.max_consecutive_skipped_steps must be >= 1 (got 0)"),
    (GenerationSettings, {"temperature": -0.5}, "model.init_args.generation.temperature must be >= 0.0 (got -0.5)"),
    (GenerationSettings, {"top_p": 1.5}, "model.init_args.generation.top_p must be in (0.0, 1.0] (got 1.5)"),
    (GenerationSettings, {"top_p": 0.0}, "model.init_args.generation.top_p must be in (0.0, 1.0] (got 0.0)"),
    (GenerationSettings, {"max_new_tokens": 0}, "model.init_args.generation.max_new_tokens must be >= 1 (got 0)"),
    (GenerationSettings, {"top_k": -1}, "model.init_args.generation.top_k must be >= 0 (got -1)"),
    (OptimizerSettings, {"lr": -1e-3}, "model.init_args.optimizer.lr must be > 0.0 (got -0.001)"),
    (OptimizerSettings, {"betas": (0.9, 1.0)}, "model.init_args.optimizer.betas[1] must be in [0.0, 1.0) (got 1.0)"),
    (OptimizerSettings, {"schedule": "linear"}, "model.init_args.optimizer.schedule must be 'constant' or 'cosine'"),
    (MemAgentWorkflow, {"max_chunks": 0}, "model.init_args.workflow.init_args.max_chunks must be >= 1 (got 0)"),
    (MemRLDataModule, {"batch_size": 0}, "data.init_args.batch_size must be >= 1 (got 0)"),
    (MemRLDataModule, {"val_batch_size": 0}, "data.init_args.val_batch_size must be >= 1 (got 0)"),
]


@pytest.mark.parametrize(("cls", "kwargs", "message"), BAD, ids=[f"{c.__name__}-{k}" for c, k, _ in BAD])
def test_bad_value_stops_naming_the_option_and_range(cls, kwargs, message):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert message in str(err.value)


def test_defaults_and_edges_are_accepted():
    GRPOSettings(group_size=2, clip_low=0.0, kl_coef=0.0, dual_clip=None, max_grad_norm=0.0, entropy_coef=-0.01)
    GenerationSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1)
    OptimizerSettings(lr=1e-6, betas=(0.0, 0.999), schedule="cosine")
    MemAgentWorkflow(max_chunks=None)
    MemAgentWorkflow(max_chunks=1)
    MemRLDataModule(batch_size=1, val_batch_size=1)


def test_check_option_messages():
    with pytest.raises(ConfigError, match=r"^x must be < 3 \(got 3\)$"):
        check_option("x", 3, high=3, high_open=True)
    with pytest.raises(ConfigError, match=r"^x must be a finite number \(got inf\)$"):
        check_option("x", float("inf"))
    check_option("x", 0, 0, 1)


def test_find_user_error_walks_the_chain():
    try:
        try:
            raise ConfigError("the option")
        except ConfigError as inner:
            raise ValueError("Does not validate against any of the Union subtypes") from inner
    except ValueError as outer:
        assert str(find_user_error(outer)) == "the option"
    assert find_user_error(RuntimeError("x")) is None


def test_every_shipped_config_passes_the_checks(tmp_path, monkeypatch):
    """configs/*/*.yaml instantiate (model and data) with the checks in place, as `lightning-memrl` parses them."""
    from helpers import parsed_cli

    from lightning_memrl.sft import MemorySFTModule

    monkeypatch.chdir(tmp_path)
    configs = sorted(p for p in (REPO / "configs").glob("*/*.yaml") if p.parent.name not in ("strategies", "shared"))
    assert len(configs) >= 7
    cpu = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.logger=false"]
    kinds = set()
    for config in configs:
        args = ["--config", str(config), *cpu, "--trainer.precision=32-true"]
        if "sft" in config.name:  # the warm-start stage's data needs its LoCoMo path (read at setup)
            args.append(f"--data.init_args.locomo_path={tmp_path}")
        cli = parsed_cli(args)  # the command's bases: any class_path (GRPO or the warm-start stage)
        if isinstance(cli.model, MemorySFTModule):
            kinds.add("sft")
            assert cli.datamodule.batch_size >= 1, config.name
        else:
            kinds.add("grpo")
            assert isinstance(cli.model, MemRLModule) and isinstance(cli.datamodule, MemRLDataModule), config.name
            assert cli.model.grpo.group_size >= 2 and cli.datamodule.batch_size >= 1, config.name
    assert kinds == {"grpo", "sft"}


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--model.init_args.grpo.group_size=1", "model.init_args.grpo.group_size must be >= 2 (got 1)"),
        ("--data.init_args.batch_size=0", "data.init_args.batch_size must be >= 1 (got 0)"),
    ],
)
def test_command_line_prints_one_message_and_exits_non_zero(tmp_path, option, message):
    exe = Path(sys.executable).with_name("lightning-memrl")
    proc = subprocess.run(
        [str(exe), "fit", "--config", TINY, option],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr and "Union subtypes" not in proc.stderr
    assert not (tmp_path / "logs").exists()  # stopped before any training or logging
