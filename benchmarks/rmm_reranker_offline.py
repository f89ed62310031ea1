"""Can RMM's reranker learn from evidence rewards on conversations it did not train on? Checked offline.

    python benchmarks/rmm_reranker_offline.py --locomo PATH --conversations conv-26 conv-30 conv-41 conv-42

The online arm of ``benchmarks/rmm.py`` spends about a minute per step on the generator's answers, though
the evidence reward (+1 when a shown memory holds one of the question's annotated evidence turns, −1
otherwise; not RMM's citation reward) does not need them. This script trains the same reranker with the
same rule away from the generator, so learning rates and step counts can be tried in minutes:

1. The memory banks of ``--conversations`` are built once by RMM's prospective reflection
   (``RMMWorkflow.build_banks``, greedy, the workflow options of ``configs/rmm/locomo.yaml``, the base
   ``--model``) and cached in ``--banks`` (JSON; reused when it exists).
2. Each question with evidence retrieves its first-stage top ``top_k`` (the config's retriever) and embeds the
   question and the candidates with ``--embedding``.
3. Leave one conversation out: for each held conversation, lr, step count and seed, a fresh reranker
   (identity adapters) trains on the other conversations' questions, ``--questions_per_step`` questions a
   step. ``--objective reinforce`` (default): ``--group_size`` Gumbel top-``top_m`` selections per question,
   scored with the workflow's own functions (:func:`gumbel_top_m`, :func:`selection_log_probs`,
   :func:`evidence_rewards`, :func:`reinforce_loss`) and its running-mean baseline. ``supervised``:
   cross-entropy on the evidence labels of the candidates, a bound on what the adapters can learn from
   these questions (not RMM). Both with the learner's optimizer (AdamW, no weight decay).
4. Reported per fold: Recall@``top_m`` of the evidence turns among the sources of the ``top_m`` memories
   the reranker keeps without noise, trained against identity (the gain), and the same gain on the
   training questions themselves (whether the rule fits what it trains on); per conversation, the
   identity's Recall@``top_m``, the first stage's Recall@``top_m`` in its own order (no reranking) and
   its Recall@``top_k`` (the most any reranking reaches). ``--first_stage_feature`` trains the reranker
   with a learned weight on the first-stage scores, ``--source_turn_feature`` on each candidate's best-matching
   source dialogue turn (neither is RMM; see ``Reranker``). ``--held_apart`` trains the best leave-one-out
   setting on every question and scores it once on a conversation the tuning never read, next to the identity
   and the features at a hand-set weight of 1 (what they give without learning).

Only the conversations named are read, so the held-apart one of ``benchmarks/rmm.py`` stays unseen while
tuning. Results: ``benchmarks/results/rmm_reranker_offline[_<tag>].json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu  # noqa: E402
from rmm import CONFIG  # noqa: E402  (the RMM benchmark's config: the same workflow options)
from rmm_banks import load_banks, load_tasks  # noqa: E402

from lightning_memrl.evaluation.metrics import evidence_recall  # noqa: E402
from lightning_memrl.memory.bank import MemoryBank  # noqa: E402
from lightning_memrl.workflows.bank import conversation_of  # noqa: E402
from lightning_memrl.workflows.rmm import RMMWorkflow  # noqa: E402
from lightning_memrl.workflows.rmm_reranker import (  # noqa: E402
    Reranker,
    evidence_rewards,
    gumbel_top_m,
    reinforce_loss,
    selection_log_probs,
)


class Question(NamedTuple):
    """One question's first-stage candidates, as the reranker sees them."""

    query: Tensor  # [D]
    memories: Tensor  # [K, D]
    sources: list[list[str]]  # source dia_ids of each candidate
    evidence: list[str]  # the question's evidence dia_ids
    first_stage: Tensor  # [K] the candidates' first-stage scores, best first
    source_turns: Tensor | None  # [K] each candidate's best source-turn match (with --source_turn_feature)

    @property
    def scored(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The reranker's inputs: query, memories, first-stage and source-turn scores."""
        return self.query, self.memories, self.first_stage, self.source_turns


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--locomo", required=True, help="LoCoMo JSON file or folder")
    p.add_argument("--conversations", nargs="+", required=True, help="development conversations (>= 2)")
    p.add_argument("--max_sessions", type=int, default=2, help="sessions read per conversation (0: all)")
    p.add_argument("--max_questions", type=int, default=0, help="questions per conversation (0: all)")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="the reflection's model")
    p.add_argument("--dtype", default="auto", help="its weight dtype")
    p.add_argument("--embedding", default="sentence-transformers", help="hashing | sentence-transformers")
    p.add_argument("--banks", type=Path, default=None, help="bank cache (default: logs/rmm_banks_<tag>.json)")
    p.add_argument("--top_k", type=int, default=10, help="first-stage candidates per question (RMM's K)")
    p.add_argument("--top_m", type=int, default=5, help="memories the reranker keeps (RMM's M; Recall@M)")
    p.add_argument("--temperature", type=float, default=0.5, help="softmax temperature of the selection")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 1e-4, 1e-5], help="learning rates tried")
    p.add_argument("--steps", type=int, nargs="+", default=[16, 64], help="optimizer step counts tried")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of each fold")
    p.add_argument("--questions_per_step", type=int, default=4, help="questions per optimizer step")
    p.add_argument("--group_size", type=int, default=2, help="sampled selections per question")
    p.add_argument(
        "--objective", choices=["reinforce", "supervised"], default="reinforce",
        help="reinforce: the workflow's rule on evidence rewards; supervised: cross-entropy on the evidence labels "
        "(a bound on what the adapters can learn from these questions, not RMM)",
    )  # fmt: skip
    p.add_argument(
        "--first_stage_feature", action="store_true",
        help="the reranker also learns a weight on the standardised first-stage score (not RMM; starts at 0)",
    )  # fmt: skip
    p.add_argument(
        "--source_turn_feature", action="store_true",
        help="the reranker also learns a weight on each candidate's best source-turn match (not RMM; starts at 0)",
    )  # fmt: skip
    p.add_argument(
        "--feature_lr_scale", type=float, default=1.0, help="learning-rate multiplier of the feature weights"
    )
    p.add_argument(
        "--weight_decay", type=float, default=0.0, help="AdamW weight decay (pulls the adapters to identity)"
    )
    p.add_argument("--baseline_momentum", type=float, default=0.9, help="running-mean factor of the baseline")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--tag", default="", help="suffix of the result and bank file names")
    p.add_argument(
        "--held_apart", default=None,
        help="a conversation no (lr, steps) choice reads: the best leave-one-out setting, trained on every "
        "--conversations question, is evaluated on it once",
    )  # fmt: skip
    args = p.parse_args(argv)
    if len(args.conversations) < 2:
        p.error("--conversations needs at least 2 conversations: one is held out in turn")
    if args.held_apart in args.conversations:
        p.error(f"--held_apart {args.held_apart} is also in --conversations: it must stay unseen while tuning")
    if not 1 <= args.top_m <= args.top_k:
        p.error(f"--top_m must lie in 1..--top_k, got --top_m {args.top_m} --top_k {args.top_k}")
    args.banks = args.banks or Path("logs") / f"rmm_banks{'_' + args.tag if args.tag else ''}.json"
    return args


def workflow_of(args: argparse.Namespace) -> RMMWorkflow:
    """RMM's workflow with ``configs/rmm/locomo.yaml``'s options, the chosen embedding, ``top_k`` and ``top_m``."""
    options = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["workflow"]["init_args"]
    options.pop("judge", None)
    options.update(embedding=args.embedding, top_k=args.top_k, top_m=args.top_m, temperature=args.temperature)
    options.update(first_stage_feature=args.first_stage_feature, source_turn_feature=args.source_turn_feature)
    options.update(feature_lr_scale=args.feature_lr_scale)
    options["train_generator"] = False  # the base model reflects; nothing here trains it
    return RMMWorkflow(**options)


def questions_of(workflow: RMMWorkflow, bank: MemoryBank, tasks: list[Any], skipped: dict[str, int]) -> list[Question]:
    """Each task with evidence and at least one first-stage candidate; ``skipped`` counts the others."""
    out = []
    for task in tasks:
        evidence = task.meta.get("evidence") or []
        retrieved = bank.retrieve(task.question, workflow.top_k, workflow.min_retrieval_score)
        candidates = [e for e, _ in retrieved]
        if not evidence or not candidates:
            skipped["no evidence" if not evidence else "no candidate"] += 1
            continue
        query = workflow.embedder.embed([task.question])[0]  # [D]
        memories = workflow.embedder.embed([e.text for e in candidates])  # [K, D]
        first_stage = torch.tensor([score for _, score in retrieved])  # [K]
        sources = [list(e.source_ids) for e in candidates]
        turns = workflow.source_turns(query, conversation_of(task), sources) if workflow.source_turns else None
        out.append(Question(query, memories, sources, evidence, first_stage, turns))
    return out


def recall_at_m(reranker: Reranker, questions: list[Question], top_m: int) -> float:
    """Mean Recall@``top_m`` of the evidence turns among the sources of the noiseless top ``top_m``."""
    values = []
    with torch.no_grad():
        for q in questions:
            kept = torch.topk(reranker(*q.scored), min(top_m, len(q.sources))).indices.tolist()
            values.append(evidence_recall({s for i in kept for s in q.sources[i]}, q.evidence))
    return statistics.fmean(values)


def first_stage_recall(questions: list[Question], top_m: int) -> float:
    """Mean Recall@``top_m`` of the first stage's own best ``top_m`` (no reranking: plain BM25 / dense)."""
    return statistics.fmean(
        evidence_recall({s for sources in q.sources[:top_m] for s in sources}, q.evidence) for q in questions
    )


def reinforce_step_loss(reranker: Reranker, batch: list[Question], args: argparse.Namespace, baseline: float):
    """The workflow's REINFORCE loss over ``--group_size`` Gumbel selections per question, and the rewards."""
    losses, rewards = [], []
    for q in batch:
        for _ in range(args.group_size):
            scores = reranker(*q.scored)  # [K]
            chosen = gumbel_top_m(scores, args.top_m, args.temperature)  # [M]
            reward = evidence_rewards([q.sources[i] for i in chosen.tolist()], q.evidence)  # [M]
            losses.append(reinforce_loss(selection_log_probs(scores, chosen, args.temperature), reward, baseline))
            rewards.append(reward)
    return torch.stack(losses).mean(), float(torch.cat(rewards).mean())


def supervised_step_loss(reranker: Reranker, batch: list[Question], args: argparse.Namespace) -> Tensor:
    """Cross-entropy of ``softmax(scores / temperature)`` [K] against the candidates holding evidence,
    spread evenly over them: the reranker told the labels, a bound on what its adapters can learn (not RMM)."""
    losses = []
    for q in batch:
        labels = torch.tensor([1.0 if set(q.evidence) & set(s) else 0.0 for s in q.sources])  # [K]
        if labels.sum() > 0:  # no candidate holds evidence: nothing to pull up
            log_probs = torch.log_softmax(reranker(*q.scored) / args.temperature, dim=-1)  # [K]
            losses.append(-(log_probs * labels).sum() / labels.sum())
    return torch.stack(losses).mean() if losses else torch.zeros((), requires_grad=True)


def train_reranker(questions: list[Question], lr: float, steps: int, seed: int, args: argparse.Namespace) -> Reranker:
    """A fresh reranker after ``steps`` steps of ``--objective`` (REINFORCE: as the workflow trains it online)."""
    torch.manual_seed(seed)
    dim = questions[0].query.numel()
    reranker = Reranker(dim, args.first_stage_feature, args.source_turn_feature, args.feature_lr_scale)
    optimizer = torch.optim.AdamW(reranker.parameters(), lr=lr, weight_decay=args.weight_decay)
    baseline, order = 0.0, []
    for _ in range(steps):
        while len(order) < args.questions_per_step:
            order += torch.randperm(len(questions)).tolist()
        batch, order = [questions[i] for i in order[: args.questions_per_step]], order[args.questions_per_step :]
        if args.objective == "supervised":
            loss = supervised_step_loss(reranker, batch, args)
        else:
            loss, mean_reward = reinforce_step_loss(reranker, batch, args, baseline)
            baseline = args.baseline_momentum * baseline + (1 - args.baseline_momentum) * mean_reward
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return reranker


def sweep(args: argparse.Namespace, data: dict[str, list[Question]]) -> list[dict[str, Any]]:
    """Every (lr, steps): per held-out conversation and seed, Recall@M trained minus identity; also the identity's
    Recall@M and the first stage's Recall@K (what any reranker of the K candidates can reach)."""
    identity = {c: recall_at_m(Reranker(qs[0].query.numel()), qs, args.top_m) for c, qs in data.items()}
    ceiling = {c: recall_at_m(Reranker(qs[0].query.numel()), qs, args.top_k) for c, qs in data.items()}
    in_order = {c: first_stage_recall(qs, args.top_m) for c, qs in data.items()}
    print(f"Recall@{args.top_m} of the first stage's own order: ", end="")
    print(", ".join(f"{c} {100 * in_order[c]:.1f}" for c in data))
    print(f"Recall@{args.top_m} of the identity (and of all top {args.top_k} candidates): ", end="")
    print(", ".join(f"{c} {100 * identity[c]:.1f} ({100 * ceiling[c]:.1f})" for c in data))
    rows = []
    for lr in args.lrs:
        for steps in args.steps:
            gains: dict[str, list[float]] = {}
            fitted: list[float] = []  # the same on the training questions: does the rule fit what it sees?
            for held in data:
                train = [q for c, qs in data.items() if c != held for q in qs]
                start = recall_at_m(Reranker(train[0].query.numel()), train, args.top_m)
                gains[held] = []
                for seed in args.seeds:
                    reranker = train_reranker(train, lr, steps, seed, args)
                    gains[held].append(recall_at_m(reranker, data[held], args.top_m) - identity[held])
                    fitted.append(recall_at_m(reranker, train, args.top_m) - start)
            flat = [g for values in gains.values() for g in values]
            row = {"lr": lr, "steps": steps, "mean_gain": statistics.fmean(flat), "gains": gains}
            row["mean_training_gain"] = statistics.fmean(fitted)
            row["folds_improved"] = sum(statistics.fmean(v) > 0 for v in gains.values())
            row["folds_worse"] = sum(statistics.fmean(v) < 0 for v in gains.values())
            print(
                f"lr {lr:g}, {steps} steps: mean Recall@{args.top_m} gain {100 * row['mean_gain']:+.1f} points "
                f"(on its training questions {100 * row['mean_training_gain']:+.1f}); "
                f"folds better / worse: {row['folds_improved']} / {row['folds_worse']} of {len(gains)}",
                flush=True,
            )
            rows.append(row)
    return [{"identity_recall": identity, "first_stage_recall": ceiling, "first_stage_order_recall": in_order}, *rows]


def hand_set(dim: int, args: argparse.Namespace) -> Reranker:
    """The untrained reranker with each optional feature's weight set to 1 by hand: what the features give
    without learning (the identity when there is none)."""
    reranker = Reranker(dim, args.first_stage_feature, args.source_turn_feature, args.feature_lr_scale)
    with torch.no_grad():
        for weight in (reranker.first_stage_weight, reranker.source_turn_weight):
            if weight is not None:
                weight.fill_(1.0 / args.feature_lr_scale)  # the weight the scores see: 1
    return reranker


def evaluate_held_apart(
    args: argparse.Namespace, data: dict[str, list[Question]], held: list[Question], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The (lr, steps) of the best mean leave-one-out gain, trained on every question of ``data`` (each seed),
    evaluated on the held-apart questions against the identity, the first stage's order and its top K."""
    best = max(runs, key=lambda row: row["mean_gain"])
    train = [q for qs in data.values() for q in qs]
    identity = recall_at_m(Reranker(held[0].query.numel()), held, args.top_m)
    trained = [
        recall_at_m(train_reranker(train, best["lr"], best["steps"], s, args), held, args.top_m) for s in args.seeds
    ]
    result = {
        "conversation": args.held_apart,
        "questions": len(held),
        "chosen": {"lr": best["lr"], "steps": best["steps"], "mean_leave_one_out_gain": best["mean_gain"]},
        "identity_recall": identity,
        "first_stage_order_recall": first_stage_recall(held, args.top_m),
        "first_stage_recall": recall_at_m(Reranker(held[0].query.numel()), held, args.top_k),
        "hand_set_recall": recall_at_m(hand_set(held[0].query.numel(), args), held, args.top_m),
        "trained_recall": trained,
        "mean_gain": statistics.fmean(trained) - identity,
    }
    print(
        f"held apart {args.held_apart} ({len(held)} questions; lr {best['lr']:g}, {best['steps']} steps): "
        f"Recall@{args.top_m} identity {100 * identity:.1f}, "
        f"first stage {100 * result['first_stage_order_recall']:.1f}, "
        f"trained {', '.join(f'{100 * r:.1f}' for r in trained)} (mean gain {100 * result['mean_gain']:+.1f})"
    )
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _args(argv)
    bu.set_threads(args.threads)
    workflow = workflow_of(args)
    tasks = load_tasks(args)
    cache = load_banks(args, workflow, tasks)
    skipped = {"no evidence": 0, "no candidate": 0}
    data = {}
    for conversation in tasks:
        bank = workflow.new_bank()
        bank.load_state_dict(cache["banks"][conversation])
        data[conversation] = questions_of(workflow, bank, tasks[conversation], skipped)
        print(f"{conversation}: bank of {len(bank)} memories, {len(data[conversation])} questions scored")
    if any(n for n in skipped.values()):
        print(f"questions skipped: {skipped}")
    empty = [c for c, qs in data.items() if not qs]
    if empty:
        raise SystemExit(f"no question of {empty} has first-stage candidates: the reflection wrote no memory there")
    counts = {c: len(qs) for c, qs in data.items()}
    held = data.pop(args.held_apart) if args.held_apart else None
    identity, *rows = sweep(args, data)
    result = {
        "command": "python benchmarks/rmm_reranker_offline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bu.machine(args.threads),
        "model": cache["model"],
        "bank_build_s": cache["build_s"],
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "questions": counts,
        "bank_sizes": {c: len(cache["banks"][c]["entries"]) for c in tasks},
        "skipped": skipped,
        **identity,
        "runs": rows,
        "held_apart": evaluate_held_apart(args, data, held, rows) if held else None,
    }
    path = bu.write_result("rmm_reranker_offline" + (f"_{args.tag}" if args.tag else ""), result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
