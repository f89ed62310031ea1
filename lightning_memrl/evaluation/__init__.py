"""Evaluation: answer metrics, the LLM judge, and the report (tables and the files they write)."""

from lightning_memrl.evaluation.judge import JudgeError, LLMJudge
from lightning_memrl.evaluation.metrics import bleu1, evidence_recall

__all__ = ["JudgeError", "LLMJudge", "bleu1", "evidence_recall"]
