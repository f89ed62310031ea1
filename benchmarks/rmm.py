"""RMM's reranker on LoCoMo, evaluated on a held-apart conversation: plain retrieval, the identity reranker,
and the reranker trained online from citation rewards (RMM's) or from evidence annotations.

    python benchmarks/rmm.py --locomo PATH --train conv-26 conv-30 conv-41 conv-42 --held-apart conv-43

Every arm is one ``lightning-memrl validate`` of ``configs/rmm/locomo.yaml`` on the held-apart conversation
(a subprocess; ``--in_process`` runs it in this process), with the reranker keeping ``--recall_k`` memories,
so the report's ``evidence_recall`` (share of the question's evidence turns among the sources of the
memories shown to the generator) is Recall@k of the memory units RMM's prospective reflection built:

====================  ==============================================================================
arm                   what orders the memories the generator sees
====================  ==============================================================================
bm25                  BM25 alone: first stage of ``--recall_k`` candidates, nothing left to rerank
dense                 cosine similarity of the ``--embedding`` vectors alone, the same way
identity              the reranker at its initialisation (identity adapters) over BM25's top ``top_k``
reranker_citation     the reranker after ``--steps`` online REINFORCE steps on citation rewards (RMM's)
reranker_evidence     the same steps on evidence rewards (+1 when a shown memory holds an annotated
                      evidence turn; NOT RMM's reward, a supervised signal from LoCoMo's annotations)
====================  ==============================================================================

The trained arms first run ``lightning-memrl fit`` on the training conversations with ``train_generator:
false`` (only the reranker learns; the generator and the reflection are the base model, greedy for the
reflection), then validate their last checkpoint. Results: ``<out>/<arm>/result.json`` (overall and by
category: Recall@k, the first stage's recall of its top ``top_k``, EM, F1, BLEU-1, citation reward; for
trained arms the fit's command, wall time and reranker metrics), ``eval_report.json``,
``predictions.jsonl``, each written as it finishes (a finished arm is skipped on a rerun), then
``summary.json``. Options the script does not know (``--model.init_args.generation.max_new_tokens=16``) go
to every fit and validate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablation import _csv_mean, run_cli  # noqa: E402
from memory_r1 import (  # noqa: E402
    _common,
    _data_args,
    _shown,
    _val_caps,
    add_split_options,
    data_caps,
    run_machine,
    save_report,
    scores,
    write_summary,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "rmm" / "locomo.yaml"
OUT = Path(__file__).parent / "results" / "rmm"
W = "--model.init_args.workflow.init_args."
# arm -> (reranker reward it trains on, None: not trained; first stage: None = the config's retriever and
# top_k, else a retriever that alone fills the shown memories)
ARMS: dict[str, tuple[str | None, str | None]] = {
    "bm25": (None, "bm25"),
    "dense": (None, "dense"),
    "identity": (None, None),
    "reranker_citation": ("citation", None),
    "reranker_evidence": ("evidence", None),
}
METRICS = ("evidence_recall", "evidence_recall_at_k", "exact_match", "f1", "bleu1", "citation_reward")
FIT_METRICS = ("reranker/reward", "reranker/citation_reward", "reranker/cited_frac", "reranker/reward_varied_groups")


def _args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_split_options(p, list(ARMS), OUT, Path("logs/bench_rmm"))
    p.add_argument(
        "--embedding", default="hashing", choices=["hashing", "sentence-transformers"],
        help="vectors of the reranker and of the dense arm (sentence-transformers: the dense extra)",
    )  # fmt: skip
    p.add_argument("--recall_k", type=int, default=5, help="memories shown to the generator (RMM's M): Recall@k")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps of each trained arm")
    p.add_argument("--questions_per_step", type=int, default=4, help="questions per step (x group_size)")
    p.add_argument("--reranker_lr", type=float, default=None, help="reranker learning rate (default: the config's)")
    p.add_argument("--top_k", type=int, default=None, help="first-stage candidates K of the rerankers")
    p.add_argument(
        "--source_turn_feature", action="store_true",
        help="the trained arms also learn the source-turn feature (not RMM; its weight starts at 0)",
    )  # fmt: skip
    p.add_argument(
        "--generator_adapter", type=Path, default=None,
        help="a warm-started generator (configs/rmm/sft.yaml's adapter) for every arm; the reflection stays the base's",
    )  # fmt: skip
    p.add_argument(
        "--bank_cache", type=Path, default=None,
        help="workflow bank_cache of every run: the reflection's banks are built once and read after",
    )  # fmt: skip
    return p.parse_known_args(argv)


def run_args(args: argparse.Namespace, root: Path, arm: str) -> list[str]:
    """``configs/rmm/locomo.yaml`` trained on ``--train`` and validated on ``--held-apart``, as ``arm`` sets it."""
    reward, first_stage = ARMS[arm]
    out = [
        *_common(args, CONFIG, root),
        *_data_args(args, "locomo", args.train),
        "--data.init_args.locomo_val_conversations", "0",
        *_data_args(args, "locomo_val", [args.held_apart]),
        "--data.init_args.batch_size", str(args.questions_per_step),
        "--data.init_args.val_batch_size", str(_val_caps(args)[1] or 100_000),  # 0: every question
        f"{W}embedding", args.embedding,
        f"{W}top_m", str(args.recall_k),
        f"{W}train_generator", "false",
    ]  # fmt: skip
    if first_stage is not None:  # the first stage alone: it retrieves exactly the memories shown
        out += [f"{W}retriever", first_stage, f"{W}top_k", str(args.recall_k)]
    elif args.top_k is not None:
        out += [f"{W}top_k", str(args.top_k)]
    if reward is not None:
        out += [f"{W}reranker_reward", reward, f"{W}source_turn_feature", str(args.source_turn_feature).lower()]
    if args.bank_cache is not None:
        out += [f"{W}bank_cache", str(args.bank_cache.resolve())]
    if args.reranker_lr is not None:
        out += [f"{W}reranker_lr", str(args.reranker_lr)]
    if args.generator_adapter is not None:  # the generator answers with it; reflect_with_base keeps the banks
        out += ["--model.init_args.lora.adapter_name_or_path", str(args.generator_adapter.resolve())]
        out += [f"{W}reflect_with_base", "true"]
    return out


def fit(args: argparse.Namespace, arm: str, extra: list[str]) -> dict[str, Any]:
    """Train ``arm``'s reranker; its command, wall time and reranker metrics (first and last step, mean)."""
    root = args.work / arm / "fit"
    command = ["fit", *run_args(args, root, arm), *extra, "--trainer.max_steps", str(args.steps)]
    command += ["--trainer.limit_val_batches", "0"]  # evaluated apart, by validate
    wall = run_cli(command, root, args.in_process)
    metrics = max(root.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    info: dict[str, Any] = {"command": _shown(command, args), "fit_wall_s": round(wall, 1), "steps": args.steps}
    info["step_time_s"] = _csv_mean(metrics, "time/step_s")
    for name in FIT_METRICS:
        info[f"mean train/{name}"] = _csv_mean(metrics, f"train/{name}")
    return info


def run_arm(args: argparse.Namespace, arm: str, extra: list[str]) -> dict[str, Any]:
    """Train (trained arms) and validate ``arm``; write ``<out>/<arm>/`` (result.json last)."""
    shutil.rmtree(args.work / arm, ignore_errors=True)
    (args.work / arm / "fit").mkdir(parents=True)
    trained = fit(args, arm, extra) if ARMS[arm][0] else None
    root = args.work / arm / "eval"
    root.mkdir(parents=True)
    command = ["validate", *run_args(args, root, arm), *extra, "--trainer.limit_val_batches", "1"]
    if trained:
        command += ["--ckpt_path", str((args.work / arm / "fit" / "checkpoints" / "last.ckpt").resolve())]
    wall = run_cli(command, root, args.in_process)
    out = args.out / arm
    report = save_report(root, out)
    result = {
        "arm": arm,
        "held_apart": args.held_apart,
        "recall_k": args.recall_k,
        **scores(report, METRICS),
        "answer_stats": answer_stats(out / "predictions.jsonl"),
        "fit": trained,
        "eval_command": _shown(command, args),
        "eval_wall_s": round(wall, 1),
        "caps": caps(args),
        "machine": run_machine(),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")  # last: marks the arm finished
    return result


def answer_stats(predictions: Path) -> dict[str, Any]:
    """How the generator answered (from the prediction rows' raw responses): the share of answers in RMM's
    format (an ``Answer:`` and a ``Citations:`` part), of answers citing a shown memory, of shown memories cited,
    and of cited and of shown memories that hold the question's evidence (questions with evidence annotated)."""
    rows = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("response") is not None]
    if not rows:
        return {"answers": 0}
    lower = [r["response"].lower() for r in rows]
    shown = sum(len(r["shown_ids"]) for r in rows)
    holds = [(i in r["cited"], reward > 0) for r in rows for i, reward in enumerate(r.get("evidence_rewards") or [])]
    cited_holds = [h for c, h in holds if c]
    return {
        "answers": len(rows),
        "in_format": sum("answer:" in t and "citation" in t for t in lower) / len(rows),
        "citing": sum(bool(r["cited"]) for r in rows) / len(rows),
        "cited_per_shown": sum(len(r["cited"]) for r in rows) / shown if shown else None,
        "cited_holding_evidence": sum(cited_holds) / len(cited_holds) if cited_holds else None,
        "shown_holding_evidence": sum(h for _, h in holds) / len(holds) if holds else None,
    }


def caps(args: argparse.Namespace) -> dict[str, Any]:
    """What was capped so that each arm fits its time budget."""
    return {
        **data_caps(args),
        "steps": args.steps,
        "questions_per_step": args.questions_per_step,
        "group_size": "configs/shared/locomo_grpo.yaml (2)",
        "embedding": args.embedding,
        "reranker_lr": args.reranker_lr or "configs/rmm/locomo.yaml (1e-3)",
        "top_k": args.top_k or "configs/rmm/locomo.yaml (10)",
        "source_turn_feature": args.source_turn_feature,
        "generator_adapter": str(args.generator_adapter) if args.generator_adapter else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, extra = _args(argv)
    if args.held_apart in args.train:
        raise SystemExit(f"--held-apart {args.held_apart} is also in --train: keep it apart")
    results = {}
    for arm in args.arms:
        path = args.out / arm / "result.json"
        if path.is_file():
            print(f"arm {arm}: done before, skipped ({path})")
            results[arm] = json.loads(path.read_text())
        else:
            results[arm] = run_arm(args, arm, extra)
    write_summary(args.out, results, METRICS, caps(args))
    return results


if __name__ == "__main__":
    main()
