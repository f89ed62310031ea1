"""examples/memory_recall_reward.py: a reward that reads the trajectory's memories, on hand-built
trajectories and added to the reward list through the real CLI."""

from __future__ import annotations

import csv
import math
import sys

import torch
from helpers import answered
from test_cli import REPO, TINY, _cli, _logs, _ok

from lightning_memrl.learner import score_trajectories
from lightning_memrl.rewards import ExactMatch
from lightning_memrl.types import RolloutBatch

sys.path.insert(0, str(REPO / "examples"))
from memory_recall_reward import MemoryRecall  # noqa: E402


def test_memory_recall_scores_the_final_memory() -> None:
    recall = MemoryRecall()
    gold = ["Paris", "the Eiffel Tower"]
    assert recall(answered("x", gold, memories=["Paris is far.", "Notes: Eiffel Tower, in PARIS."])) == 1.0
    # both answers were read, then forgotten before the answer turn: only the final memory counts
    assert recall(answered("x", gold, memories=["Paris, Eiffel Tower", "Notes: Lyon."])) == 0.0
    assert recall(answered("x", ["4821", "7004"], memories=["the code is 4821"])) == 0.5
    assert recall(answered("x", ["a"], memories=["a b"])) == 0.0  # "a" normalises to nothing: never counts
    assert recall(answered("x", gold, memories=[])) is None  # no memory turn: unscored
    assert recall(answered("x", [], memories=["Paris"])) is None


def test_memory_recall_in_the_weighted_reward_sum() -> None:
    trajectories = [
        answered(r"\boxed{Paris}", ["Paris", "Eiffel Tower"], memories=["Paris"]),  # EM 1, recall 1/2
        answered("Lyon", ["Paris", "Eiffel Tower"], memories=["nothing"]),  # EM 0, recall 0
        answered(r"\boxed{Paris}", ["Paris"], memories=[]),  # EM 1, recall unscored
    ]
    rollouts = RolloutBatch.from_trajectories(trajectories, group_size=3, pad_id=0)
    total, components, nonfinite = score_trajectories([ExactMatch(), MemoryRecall(weight=0.5)], rollouts)
    torch.testing.assert_close(total, torch.tensor([1.0 + 0.5 * 0.5, 0.0, 1.0]))
    torch.testing.assert_close(components["memory_recall"], torch.tensor([0.5, 0.0, math.nan]), equal_nan=True)
    assert nonfinite == 0


def test_memory_recall_added_from_yaml(tmp_path) -> None:
    config = str(REPO / "examples" / "memory_recall_reward.yaml")
    args = ("--trainer.max_steps", "2", "--trainer.num_sanity_val_steps", "0")
    _ok(_cli("fit", "--config", TINY, "--config", config, *args, cwd=tmp_path, extra_path=str(REPO / "examples")))
    ckpt = torch.load(_logs(tmp_path) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    paths = [r["class_path"] for r in ckpt["hyper_parameters"]["rewards"]]
    assert paths == [
        "lightning_memrl.rewards.ExactMatch",
        "lightning_memrl.rewards.BoxedFormat",
        "memory_recall_reward.MemoryRecall",
    ]
    rows = list(csv.DictReader(next((_logs(tmp_path) / "csv").glob("version_*/metrics.csv")).open()))
    recalls = [float(r["train/reward/memory_recall"]) for r in rows if r.get("train/reward/memory_recall")]
    assert len(recalls) == 2 and all(0.0 <= v <= 1.0 for v in recalls)  # one per step, a share
