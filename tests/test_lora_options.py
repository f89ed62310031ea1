"""peft's LoRA options under their peft names, a saved adapter trained further, and the reference they leave."""

from __future__ import annotations

import pytest
import torch

from lightning_memrl import ConfigError, GRPOSettings, LoraSettings, MemRLModule
from lightning_memrl.adapters import add_lora
from lightning_memrl.models import build_tiny_model, load_policy


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def test_peft_names_and_former_names():
    assert (LoraSettings().lora_alpha, LoraSettings().lora_dropout) == (32, 0.0)
    former = LoraSettings(alpha=8, dropout=0.1)
    assert (former.lora_alpha, former.lora_dropout, former.alpha, former.dropout) == (8, 0.1, None, None)
    assert LoraSettings(lora_alpha=8, lora_dropout=0.0).lora_dropout == 0.0
    with pytest.raises(ConfigError, match="lora.alpha is the former name of model.init_args.lora.lora_alpha"):
        LoraSettings(alpha=8, lora_alpha=16)
    with pytest.raises(ConfigError, match="lora.dropout is the former name of model.init_args.lora.lora_dropout"):
        LoraSettings(dropout=0.1, lora_dropout=0.1)


def test_rslora_scales_by_alpha_over_sqrt_r(tiny_tokenizer):
    plain = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=4, lora_alpha=8))
    rs = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=4, lora_alpha=8, use_rslora=True))
    assert {m.scaling["default"] for m in _lora_layers(plain).values()} == {2.0}  # alpha / r
    assert {m.scaling["default"] for m in _lora_layers(rs).values()} == {4.0}  # alpha / sqrt(r)


def test_layers_to_transform_adapts_only_those_layers(tiny_tokenizer):
    model = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=2, layers_to_transform=[1]))
    names = list(_lora_layers(model))
    assert names and all(".layers.1." in n for n in names)
    suffixes = {n.rsplit(".", 1)[-1] for n in names}  # all-linear: every linear layer of layer 1
    assert suffixes == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ConfigError, match="layers_to_transform needs .*target_modules as a list"):
        LoraSettings(layers_to_transform=0, target_modules=".*proj")


def test_reference_stays_the_base_with_dora_modules_to_save_and_random_init(tiny_tokenizer):
    lora = LoraSettings(r=2, use_dora=True, modules_to_save=["norm"], init_lora_weights=False)
    module = MemRLModule("tiny", lora=lora, grpo=GRPOSettings(kl_coef=0.1))
    module.configure_model()
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert any("lora_magnitude_vector" in n for n in trainable)  # DoRA
    assert any("modules_to_save" in n and n.endswith("model.norm.modules_to_save.default.weight") for n in trainable)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "modules_to_save" in name:
                p.mul_(3.0)  # as if trained
        ids = torch.tensor([tiny_tokenizer("Alice and Bob")["input_ids"]])
        base = build_tiny_model(tiny_tokenizer, seed=0).eval()(input_ids=ids).logits
        adapted = module.policy.eval()(input_ids=ids).logits
        with module.reference_context():
            reference = module.policy(input_ids=ids).logits
    assert not torch.allclose(adapted, base, atol=1e-3)  # random A and B, a trained norm: not the base
    torch.testing.assert_close(reference, base, atol=1e-5, rtol=0)


def test_bias_trains_base_biases_and_is_refused_when_a_reference_is_needed(tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        attention_bias=True,
    )
    model = add_lora(LlamaForCausalLM(config), LoraSettings(r=2, bias="all"))
    biases = [n for n, p in model.named_parameters() if n.endswith(".bias")]
    assert biases and all(p.requires_grad for n, p in model.named_parameters() if n.endswith(".bias"))
    with pytest.raises(ConfigError, match="bias='lora_only' trains the base model's biases.*grpo.kl_coef > 0"):
        MemRLModule("tiny", lora=LoraSettings(r=2, bias="lora_only"), grpo=GRPOSettings(kl_coef=0.1)).configure_model()
    MemRLModule("tiny", lora=LoraSettings(r=2, bias="lora_only"), grpo=GRPOSettings(kl_coef=0.0)).configure_model()


def test_init_lora_weights(tiny_tokenizer):
    zero = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=2))
    gaussian = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=2, init_lora_weights="gaussian"))
    random = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=2, init_lora_weights=False))

    def b_norm(model) -> float:
        return sum(float(m.lora_B["default"].weight.abs().sum()) for m in _lora_layers(model).values())

    assert b_norm(zero) == 0.0 and b_norm(gaussian) == 0.0 and b_norm(random) > 0.0
    with pytest.raises(ConfigError, match="init_lora_weights='pissa' is not supported: it rewrites the base weights"):
        LoraSettings(init_lora_weights="pissa")
    with pytest.raises(ConfigError, match="init_lora_weights='eva' is not supported: it needs a data-driven"):
        LoraSettings(init_lora_weights="eva")


def test_a_saved_adapter_is_loaded_trainable_with_its_own_shape(tiny_tokenizer, tmp_path):
    saved = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=4, lora_alpha=8, init_lora_weights=False))
    saved.save_pretrained(tmp_path / "adapter")
    expected = {n: p.detach().clone() for n, p in saved.named_parameters() if "lora_" in n}
    loaded_settings = LoraSettings(adapter_name_or_path=str(tmp_path / "adapter"))
    loaded = load_policy("tiny", tiny_tokenizer, lora=loaded_settings)
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == expected.keys() and len(got) == 28  # 7 linear layers x 2 layers x (A, B)
    for name, weight in got.items():
        assert torch.equal(weight, expected[name]) and weight.requires_grad, name
    assert {m.r["default"] for m in _lora_layers(loaded).values()} == {4}  # the adapter's r, not the default 16
    # the other ranks of a sharded run build the same adapter on meta; rank 0's weights fill it
    empty = load_policy("tiny", tiny_tokenizer, lora=loaded_settings, empty_weights=True)
    assert {n: p.shape for n, p in empty.named_parameters()} == {n: p.shape for n, p in loaded.named_parameters()}
    assert all(p.is_meta for p in empty.parameters())
    with pytest.raises(FileNotFoundError, match="lora.adapter_name_or_path=.*no peft adapter found"):
        load_policy("tiny", tiny_tokenizer, lora=LoraSettings(adapter_name_or_path=str(tmp_path)))
