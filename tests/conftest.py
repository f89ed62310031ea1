"""Shared fixtures: the offline tiny tokenizer and model."""

from __future__ import annotations

import pytest
import torch

from lightning_memrl.models import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    torch.manual_seed(0)
    return build_tiny_model(tiny_tokenizer, seed=0).eval()
