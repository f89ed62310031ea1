"""Sharding: a 2-process FSDP2 run on CPU (gloo), FSDP1 policies, clipping and checkpoint helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_memrl.distributed import (
    DecoderLayerFSDPStrategy,
    allow_classes_of,
    clip_grad_norm,
    decoder_layer_classes,
    equalize_micro_batches,
    fsdp1_policies,
    unsharded_for_rollout,
)
from lightning_memrl.models import LoraSettings, build_tiny_model, load_policy
from lightning_memrl.settings import GenerationSettings

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Run tests/fsdp_worker.py once: 2 steps, sharded checkpoint, resume to step 3."""
    out = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "fsdp_worker.py"), str(out)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


def test_fsdp2_parameters_are_dtensors_holding_half_the_rows(fsdp_run):
    ranks, _ = fsdp_run
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["mesh"] == {"data_parallel": 2, "tensor_parallel": 1}
    for record in ranks:
        assert record["is_dtensor"] and record["reference_dtensor"]  # the full reference copy is sharded too
        for name, (full, local) in record["shapes"].items():
            assert local == (full[0] // 2, *full[1:]), name


def test_fsdp2_loads_once_and_broadcasts_weights_and_buffers(fsdp_run, tiny_tokenizer):
    ranks, _ = fsdp_run
    expected = build_tiny_model(tiny_tokenizer, seed=0).state_dict()
    for record in ranks:  # rank 1 built its copy on the meta device and got rank 0's weights
        assert set(record["initial"]) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(record["initial"][name], value, rtol=0, atol=0)
    for name, buffer in ranks[0]["buffers"].items():  # rotary tables are not in the state dict
        torch.testing.assert_close(ranks[1]["buffers"][name], buffer, rtol=0, atol=0)


def test_fsdp2_ranks_hold_the_same_updated_parameters(fsdp_run):
    ranks, _ = fsdp_run
    end = ranks[0]["end_3"]
    changed = [k for k in end if not torch.equal(end[k], ranks[0]["initial"][k])]
    assert len(changed) == len(end)  # lr 1e-2: every tensor moved
    for name, value in end.items():
        # rank 0's rows followed by rank 1's rows are the whole updated tensor both ranks see
        whole = torch.cat([ranks[0]["local_shards"][name], ranks[1]["local_shards"][name]])
        torch.testing.assert_close(whole, value, rtol=0, atol=0)
        torch.testing.assert_close(ranks[1]["end_3"][name], value, rtol=0, atol=0)
    for record in ranks:
        assert record["unsharded_after_rollout"] == [False] * 3  # gathered for generation, resharded after


def test_fsdp2_sharded_checkpoint_resumes(fsdp_run):
    ranks, out = fsdp_run
    assert (out / "ckpt" / "last.ckpt").is_dir()  # one shard file per rank plus metadata
    for record in ranks:
        assert record["global_step_2"] == 2 and record["global_step_3"] == 3
        for name, value in record["end_2"].items():
            torch.testing.assert_close(record["start_3"][name], value, rtol=0, atol=0)


def test_fsdp2_each_rank_rolls_out_whole_groups_of_its_own_tasks(fsdp_run):
    ranks, _ = fsdp_run
    for step in range(3):
        per_rank = [record["task_ids"][step] for record in ranks]
        for ids in per_rank:  # group_size 2: members of a group are consecutive copies of one task
            assert ids[0::2] == ids[1::2]
        assert not set(per_rank[0]) & set(per_rank[1])  # the sampler split the tasks
    # ranks ran different numbers of turns (= micro-batches) in some step and still stayed in step
    assert ranks[0]["turns"] != ranks[1]["turns"]
    # train/* metrics are means over ranks
    for step in range(3):
        mean = (ranks[0]["local_reward"][step] + ranks[1]["local_reward"][step]) / 2
        assert ranks[0]["logged_reward"][step] == pytest.approx(mean, rel=1e-5)
        assert ranks[1]["logged_reward"][step] == pytest.approx(mean, rel=1e-5)


def test_decoder_layer_classes_of_plain_and_lora_models(tiny_tokenizer):
    model = build_tiny_model(tiny_tokenizer)
    assert decoder_layer_classes(model) == (LlamaDecoderLayer,)
    lora = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=2, alpha=4))
    assert decoder_layer_classes(lora) == (LlamaDecoderLayer,)
    with pytest.raises(ValueError, match="cannot find the decoder-layer class of Linear"):
        decoder_layer_classes(torch.nn.Linear(2, 2))


def test_fsdp1_policies_wrap_and_checkpoint_each_decoder_layer(tiny_tokenizer):
    model = build_tiny_model(tiny_tokenizer)
    policies = fsdp1_policies(model, activation_checkpointing=True)
    wrapped = policies["auto_wrap_policy"]._run_policy(model, set(), {})
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert len(layers) == 2 and all(layer in wrapped for layer in layers)
    assert set(wrapped) == set(layers)  # only the layers (FSDP wraps the root itself)
    assert policies["activation_checkpointing_policy"] == {LlamaDecoderLayer}
    assert "activation_checkpointing_policy" not in fsdp1_policies(model)

    strategy = DecoderLayerFSDPStrategy(activation_checkpointing=True, sharding_strategy="FULL_SHARD")
    strategy.apply_decoder_layer_policies(model)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {LlamaDecoderLayer}
    check = strategy._activation_checkpointing_kwargs["auto_wrap_policy"]
    assert check._module_classes == {LlamaDecoderLayer}


def test_clip_grad_norm_returns_the_norm_and_scales_to_max_norm():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # total norm 5
    assert clip_grad_norm([a, b], max_norm=1.0) == pytest.approx(5.0)
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(b.grad, torch.tensor([0.8]), atol=1e-6, rtol=0)
    assert clip_grad_norm([a, b], max_norm=10.0) == pytest.approx(1.0, abs=1e-5)  # below max: unchanged
    torch.testing.assert_close(b.grad, torch.tensor([0.8]), atol=1e-6, rtol=0)
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0) == 0.0  # no gradients at all


def test_single_process_helpers_are_no_ops(tiny_model):
    batches = [[0, 1], [2]]
    assert equalize_micro_batches(batches) == (batches, 2)
    with unsharded_for_rollout(tiny_model):  # not sharded: nothing to gather
        pass
    classes = allow_classes_of({"generation": GenerationSettings(), "lora": None, "lr": 1e-5})
    assert classes == [GenerationSettings]
    assert GenerationSettings in torch.serialization.get_safe_globals()


def test_multi_node_configs_parse_with_print_config(tmp_path):
    exe = Path(sys.executable).with_name("lightning-memrl")
    recipe = str(TESTS.parent / "configs" / "memagent" / "qwen2.5_7b_fsdp.yaml")
    fsdp1 = str(TESTS.parent / "configs" / "strategies" / "fsdp1.yaml")
    args = [str(exe), "fit", "--config", recipe, "--trainer.num_nodes", "2", "--print_config"]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key in (
        "class_path: lightning_memrl.distributed.FSDP2Strategy",
        "param_dtype: bfloat16",
        "num_nodes: 2",
        "devices: 8",
        "model_name_or_path: Qwen/Qwen2.5-7B-Instruct",
        "attn_implementation: auto",
        "gradient_checkpointing: true",
        "group_size: 16",
    ):
        assert key in proc.stdout, key
    composed = subprocess.run(
        [*args[:4], "--config", fsdp1, "--print_config"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert composed.returncode == 0, composed.stderr[-3000:]
    assert "class_path: lightning_memrl.distributed.DecoderLayerFSDPStrategy" in composed.stdout
    assert "activation_checkpointing: true" in composed.stdout and "precision: bf16-mixed" in composed.stdout
