"""The rollout backend contract: ``MemRLModule`` builds its backend from ``rollout`` and the learner
calls ``sync_weights`` after every optimizer step that is not skipped (examples/custom_rollout_backend.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from helpers import AnswerLength, quiet_trainer
from test_cli import TINY, _cli, _logs, _ok
from test_guards import _nan_loss

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
    SyntheticTaskSettings,
)
from lightning_memrl.callbacks import MemRLCallback
from lightning_memrl.models import build_tiny_model
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.rollout.hf import RolloutEngine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=6)


@pytest.fixture()
def snapshot_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("custom_rollout_backend").SnapshotRolloutEngine


class CountingEngine(RolloutEngine):
    """The HF engine, recording each ``sync_weights`` call: (optimizer steps done, the model)."""

    def __init__(self, model, tokenizer, **kwargs) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.module, self.synced = None, []

    def sync_weights(self, model) -> None:
        self.synced.append((self.module.global_step, model))


def _module(rollout) -> MemRLModule:
    return MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2, ppo_epochs=2),  # two optimizer steps per batch
        optimizer=OptimizerSettings(lr=1e-2),
        rollout=rollout,
    )


def _data() -> MemRLDataModule:
    return MemRLDataModule(
        batch_size=1, synthetic=SyntheticTaskSettings(num_tasks=4, min_chunks=1, max_chunks=1, sentences_per_chunk=1)
    )


def test_sync_weights_follows_every_optimizer_step(tmp_path):
    module = _module(CountingEngine)
    module.configure_model()
    assert isinstance(module.engine, CountingEngine) and module.engine.model is module.policy
    module.engine.module = module
    trainer = quiet_trainer(tmp_path, steps=4)
    trainer.fit(module, _data())
    assert trainer.global_step == 4  # 2 batches x 2 PPO epochs
    assert [step for step, _ in module.engine.synced] == [0, 1, 2, 3, 4]  # at the start, then after each step
    assert all(model is module.policy for _, model in module.engine.synced)


def test_a_skipped_step_is_not_synced(tmp_path, monkeypatch):
    module = _module(CountingEngine)
    module.configure_model()
    module.engine.module = module
    _nan_loss(monkeypatch, module, {1})  # the second optimizer step (batch 0, epoch 1) has a NaN loss and is skipped
    trainer = quiet_trainer(tmp_path, steps=4)
    trainer.fit(module, _data())
    assert trainer.global_step == 4
    assert [step for step, _ in module.engine.synced] == [0, 1, 3, 4]  # none after the skipped second step


def test_a_rollout_that_builds_no_backend_stops_naming_the_option():
    module = _module(lambda model, tokenizer: object())
    with pytest.raises(TypeError, match=r"model.init_args.rollout built a builtins.object.*RolloutBackend"):
        module.configure_model()


def test_default_backend_is_the_in_process_engine_with_the_module_share_prefixes():
    module = MemRLModule(share_prefixes=False)
    module.configure_model()
    assert type(module.engine) is RolloutEngine and module.engine.model is module.policy
    assert module.engine.share_prefixes is False and isinstance(module.engine, RolloutBackend)
    with pytest.raises(TypeError, match="abstract"):
        RolloutBackend()


class _CopyMatchesPolicy(MemRLCallback):
    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        copy = module.engine.model.state_dict()
        self.rows.append(all(torch.equal(w, copy[n]) for n, w in module.policy.state_dict().items()))


def test_example_backend_samples_from_its_own_copy_kept_current_by_sync(tmp_path, snapshot_engine):
    synced, stale = _module(snapshot_engine), _module(snapshot_engine)
    for module in (synced, stale):
        module.configure_model()
        assert module.engine.model is not module.policy
    stale.engine.sync_weights = lambda model: None  # a backend nobody hands the new weights to
    matches = _CopyMatchesPolicy()
    quiet_trainer(tmp_path, steps=4, callbacks=[matches]).fit(synced, _data())
    quiet_trainer(tmp_path, steps=4).fit(stale, _data())
    assert matches.rows == [True, True] and synced.engine.synced_steps == 1 + 4  # the start, then every step

    initial = build_tiny_model(stale.tokenizer, seed=0).eval()
    stale_copy = stale.engine.model.state_dict()
    assert all(torch.equal(w, stale_copy[n]) for n, w in initial.state_dict().items())  # never refreshed
    assert any(not torch.equal(w, stale_copy[n]) for n, w in stale.policy.state_dict().items())  # policy moved
    prompts = [stale.tokenizer("The secret code of Alice is", add_special_tokens=False)["input_ids"]]
    sampled = stale.engine.generate(prompts, GREEDY)[0]  # what the stale backend samples from: its copy
    from_initial = RolloutEngine(initial, stale.tokenizer).generate(prompts, GREEDY)[0]
    from_policy = RolloutEngine(stale.policy.eval(), stale.tokenizer).generate(prompts, GREEDY)[0]
    assert sampled.token_ids == from_initial.token_ids
    torch.testing.assert_close(sampled.logprobs, from_initial.logprobs, atol=1e-6, rtol=0)
    n = min(len(sampled.logprobs), len(from_policy.logprobs))
    assert (sampled.logprobs[:n] - from_policy.logprobs[:n]).abs().max() > 1e-3


def test_example_backend_chosen_by_class_path_from_yaml(tmp_path, snapshot_engine):
    _ok(
        _cli(
            "fit",
            "--config",
            TINY,
            "--config",
            str(EXAMPLES / "custom_rollout_backend.yaml"),
            "--trainer.max_steps",
            "2",
            "--trainer.num_sanity_val_steps",
            "0",
            cwd=tmp_path,
            extra_path=str(EXAMPLES),
        )
    )
    path = _logs(tmp_path) / "checkpoints" / "last.ckpt"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    assert ckpt["hyper_parameters"]["rollout"] == {
        "class_path": "custom_rollout_backend.SnapshotRolloutEngine",
        "init_args": {"share_prefixes": True, "min_shared_prefix": 16},
    }
    module = MemRLModule.load_from_checkpoint(path, weights_only=False)  # rebuilt from the saved config
    assert isinstance(module.engine, snapshot_engine) and module.engine.model is not module.policy
    copy = module.engine.model.state_dict()
    trained = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
    assert any(not torch.equal(v, copy[k]) for k, v in trained.items())  # the copy of the initial weights
    module.engine.sync_weights(module.policy)
    assert all(torch.equal(v, module.engine.model.state_dict()[k]) for k, v in trained.items())
