"""``lightning-memrl predict``: the agent run greedily on documents, one JSON line per document.

``MemRLModule.predict_step`` hands each batch of ``data.init_args.predict_path`` documents to
:func:`predict_rows` (the workflow's rollout with the validation's greedy settings) and
:class:`PredictionWriter` appends the rows to ``<trainer.default_root_dir>/predictions.jsonl``
(or its ``output_path``) as each batch finishes. A row holds the document's id and question, the
chunks the agent read and the memory it wrote after each, the final response and the answer taken
from it, and, when the document has gold answers, their exact match and F1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_memrl.errors import ConfigError
from lightning_memrl.rewards import answer_from_completion, exact_match, token_f1
from lightning_memrl.types import Task, Trajectory
from lightning_memrl.workflows.bank import BankWorkflow


def check_predict_workflow(workflow: Any) -> None:
    """Refuse a workflow that cannot read ``predict_path`` documents: a memory bank built from LoCoMo dialogues.

    Raises:
        ConfigError: naming the workflow and what to use instead.
    """
    if isinstance(workflow, BankWorkflow):
        name = type(workflow).__name__
        raise ConfigError(
            f"lightning-memrl predict: {name} builds its memory bank from LoCoMo conversations (sessions of "
            "dialogue turns), which data.init_args.predict_path documents (question and context) do not hold. "
            "Predict with a workflow that reads a context chunk by chunk (lightning_memrl.MemAgentWorkflow), "
            f"or score {name} on LoCoMo with `lightning-memrl test`."
        )


def prediction_row(trajectory: Trajectory, answer_pattern: str | None, memory_per_chunk: bool) -> dict[str, Any]:
    """One line of ``predictions.jsonl``.

    Keys: ``id``, ``question``, ``chunks`` (the texts read, in order), ``chunks_dropped``,
    ``memories`` (the memory after each memory turn: with MemAgent, ``memories[k]`` after
    ``chunks[k]``), ``turns`` (``{kind, text}`` of every turn, for workflows whose memory is not
    one text per chunk), ``completion`` (the final response), ``answer`` (taken from it as
    validation does), and ``answers``, ``exact_match``, ``f1`` when the document has gold answers.
    """
    task = trajectory.task
    row: dict[str, Any] = {
        "id": task.id,
        "question": task.question,
        "chunks": list(trajectory.chunks),
        "chunks_dropped": trajectory.chunks_dropped,
        "memories": list(trajectory.memories),
    }
    if not memory_per_chunk:
        row["turns"] = [{"kind": turn.kind, "text": turn.text} for turn in trajectory.turns]
    answer = answer_from_completion(trajectory.final_text, answer_pattern)
    row.update(completion=trajectory.final_text, answer=answer)
    if task.answers:
        row.update(answers=task.answers, exact_match=exact_match(answer, task.answers))
        row["f1"] = token_f1(answer, task.answers)
    return row


def predict_rows(module: Any, tasks: list[Task]) -> list[dict[str, Any]]:
    """Greedy rollouts of ``tasks`` (validation's settings: ``val_max_new_tokens``) as prediction rows."""
    settings = module.generation.greedy(module.val_max_new_tokens)
    with torch.no_grad():
        rollouts = module.rollout(list(tasks), settings)
    per_chunk = module.workflow.memory_per_chunk
    return [prediction_row(t, module.answer_pattern, per_chunk) for t in rollouts.trajectories]


class PredictionWriter(BasePredictionWriter):
    """Appends each predicted batch's rows to a JSON Lines file (emptied when prediction starts).

    ``MemRLModule`` adds one to every ``predict`` whose trainer has no prediction writer; add your
    own to ``trainer.callbacks`` to choose the file.

    Args:
        output_path: the file; None: ``<trainer.default_root_dir>/predictions.jsonl``. With several
            processes each writes its own, ``predictions.rank<N>.jsonl``.
    """

    def __init__(self, output_path: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_path = output_path
        self.rows = 0

    def path(self, trainer: L.Trainer) -> Path:
        """The file this process writes."""
        path = Path(self.output_path) if self.output_path else Path(trainer.default_root_dir) / "predictions.jsonl"
        return path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}") if trainer.world_size > 1 else path

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = self.path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self.rows = 0

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Sequence[dict[str, Any]],
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        with open(self.path(trainer), "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in prediction)
        self.rows += len(prediction)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        print(f"wrote {self.rows} predictions to {self.path(trainer)}")


def prediction_writers(trainer: L.Trainer) -> list[L.Callback]:
    """A :class:`PredictionWriter` for a ``predict`` whose trainer has no prediction writer, else nothing."""
    if trainer.state.fn != "predict" or any(isinstance(c, BasePredictionWriter) for c in trainer.callbacks):
        return []
    return [PredictionWriter()]
