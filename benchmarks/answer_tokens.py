"""How the answers of evaluated arms differ in length and token overlap: mean words, token F1, precision, recall.

    python benchmarks/answer_tokens.py benchmarks/results/memory_r1_all/sft \\
        "benchmarks/results/memory_r1_all/sft+grpo_manager+grpo_answerer" \\
        --out benchmarks/results/memory_r1_all/answer_tokens.json

Each argument is a folder with the ``predictions.jsonl`` that ``lightning-memrl validate`` wrote (one row per
question, with the parsed ``answer`` and the gold ``answers``). Token F1 is the reward and report's
(``lightning_memrl.rewards.token_scores``: SQuAD normalisation, the gold answer with the best F1), split into
precision (shared tokens over the answer's) and recall (over the gold answer's): a longer answer that gains
F1 by recall alone shows here as falling precision. Rows without an ``answer`` are counted and skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import bench_utils as bu

from lightning_memrl.rewards import token_scores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arms", nargs="+", type=Path, help="folders holding predictions.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write (default: print only)")
    return parser.parse_args(argv)


def arm_stats(predictions: Path) -> dict[str, Any]:
    """Mean words and token F1 / precision / recall (in [0, 1]) of one arm's answers."""
    rows = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()]
    answered = [r for r in rows if r.get("answer") is not None]
    if not answered:
        return {"questions": 0, "skipped": len(rows)}
    scores = [token_scores(str(r["answer"]), [str(a) for a in r["answers"]]) for r in answered]
    return {
        "questions": len(answered),
        "skipped": len(rows) - len(answered),
        "words": statistics.fmean(len(str(r["answer"]).split()) for r in answered),
        "f1": statistics.fmean(s.f1 for s in scores),
        "precision": statistics.fmean(s.precision for s in scores),
        "recall": statistics.fmean(s.recall for s in scores),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    missing = [str(arm) for arm in args.arms if not (arm / "predictions.jsonl").is_file()]
    if missing:
        sys.exit(f"answer_tokens.py: no predictions.jsonl in {', '.join(missing)} (run the arm's evaluation first)")
    arms = {str(arm): arm_stats(arm / "predictions.jsonl") for arm in args.arms}
    table = [
        [name, s["questions"], s["skipped"], *(s.get(k, float("nan")) for k in ("words", "f1", "precision", "recall"))]
        for name, s in arms.items()
    ]
    print(bu.markdown_table(["arm", "questions", "skipped (no answer)", "words", "F1", "precision", "recall"], table))
    command = "python benchmarks/answer_tokens.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command, "arms": arms}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
