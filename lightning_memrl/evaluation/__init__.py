"""Evaluation: answer metrics, the LLM judge, paired comparison of runs, and the report (tables and files)."""

from lightning_memrl.evaluation.judge import JudgeError, LLMJudge
from lightning_memrl.evaluation.metrics import bleu1, evidence_recall
from lightning_memrl.evaluation.paired import PairedComparison, paired_comparison

__all__ = ["JudgeError", "LLMJudge", "PairedComparison", "bleu1", "evidence_recall", "paired_comparison"]
