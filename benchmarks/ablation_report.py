"""The ablation's report: per-arm summary, paired differences between arms, plots and the markdown table.

Reads the finished runs of ``benchmarks/ablation.py`` (``<out>/<arm>_seed<k>/result.json`` and
``predictions.jsonl``) and writes ``summary.json``, ``summary.md`` (the README's table), ``ablation_em.png``,
``retention.png`` and ``paired.png`` next to them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lightning_memrl.evaluation.paired import paired_comparison

REFERENCES = ("base", "grpo")  # every other arm is compared task by task with these (paired)
SECTIONS = ("by_num_chunks", "by_answer_position", "by_hops")  # the report's groupings a result keeps
GRPO_4_CHUNK_GAIN = 0.15  # target: plain GRPO's EM gain over the base on 4-chunk tasks ...
GRPO_MINUTES = 60.0  # ... within this many minutes of training
BEST_OVER_GRPO = 0.05  # target: the best credit arm's mean EM over plain GRPO's, seed ranges apart
RETENTION_SPREAD = 0.10  # target: EM by answer position within this range (max - min)
MIN_POSITION_TASKS = 5  # answer positions with fewer held-out tasks are left out of the retention spread


def _seed_means(runs: list[dict], section: str) -> dict[str, float]:
    """Exact match of each group of ``section`` (e.g. each answer position), averaged over the seeds."""
    keys = sorted({k for r in runs for k in r.get(section, {})}, key=lambda k: (len(k), k))  # "2" before "10"
    return {k: statistics.fmean(r[section][k]["exact_match"] for r in runs if k in r.get(section, {})) for k in keys}


def _task_scores(out: Path, arm: str, seeds: list[int]) -> dict[tuple[int, str], float]:
    """Held-out exact match per (seed, task id) of an arm's runs, from their ``predictions.jsonl``."""
    scores = {}
    for seed in seeds:
        for line in (out / f"{arm}_seed{seed}" / "predictions.jsonl").read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                scores[(seed, row["id"])] = float(row["exact_match"])
    return scores


def _paired(arms: dict[str, Any], out: Path) -> dict[str, dict[str, dict]]:
    """Each arm against the reference arms on the (seed, task) pairs both ran: mean EM difference, a
    bootstrap interval over tasks and the sign test (``lightning_memrl.evaluation.paired``)."""
    scores = {arm: _task_scores(out, arm, entry["seeds"]) for arm, entry in arms.items()}
    paired: dict[str, dict[str, dict]] = {}
    for arm in arms:
        refs = REFERENCES[: REFERENCES.index(arm)] if arm in REFERENCES else REFERENCES  # base vs grpo once
        for ref in (r for r in refs if r in arms and scores[r].keys() & scores[arm].keys()):
            result = paired_comparison(scores[ref], scores[arm], cluster_of={k: k[1] for k in scores[arm]})
            paired.setdefault(arm, {})[f"vs_{ref}"] = result.to_dict()
    return paired


def summarise(results: list[dict], out: Path) -> dict:
    """Per arm: held-out EM mean and seed spread, EM by answer position, paired differences with the
    reference arms; the two plots."""
    arms: dict[str, Any] = {}
    for arm in dict.fromkeys(r["arm"] for r in results):
        runs = [r for r in results if r["arm"] == arm]
        ems = [r["overall"]["exact_match"] for r in runs]
        times = [r["step_time_s"] for r in runs if r["step_time_s"]]
        arms[arm] = {
            "seeds": [r["seed"] for r in runs],
            "exact_match": statistics.fmean(ems),
            "exact_match_min": min(ems),
            "exact_match_max": max(ems),
            **{section: _seed_means(runs, section) for section in SECTIONS},
            "eval_memory_words": statistics.fmean(r["eval_memory_words"] for r in runs),
            "step_time_s": statistics.fmean(times) if times else None,
        }
    for arm, comparisons in _paired(arms, out).items():
        arms[arm]["paired"] = comparisons
    summary = {"arms": arms, "runs": len(results), "targets": target_readings(results, arms)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(summary_table(arms) + "\n" + targets_text(summary["targets"]))
    plot(arms, out)
    return summary


def _train_minutes(run: dict) -> float | None:
    return run["step_time_s"] * run["steps"] / 60 if run.get("step_time_s") else None


def _grpo_4_chunk_gain(results: list[dict]) -> dict[str, Any] | None:
    """Plain GRPO's 4-chunk EM minus the base's, per seed both ran, with GRPO's training minutes."""
    base = {r["seed"]: r for r in results if r["arm"] == "base"}
    pairs = [(r, base[r["seed"]]) for r in results if r["arm"] == "grpo" and r["seed"] in base]
    pairs = [(g, b) for g, b in pairs if "4" in g.get("by_num_chunks", {}) and "4" in b.get("by_num_chunks", {})]
    if not pairs:
        return None
    gains = [g["by_num_chunks"]["4"]["exact_match"] - b["by_num_chunks"]["4"]["exact_match"] for g, b in pairs]
    minutes = [m for g, _ in pairs if (m := _train_minutes(g)) is not None]
    mean_minutes = statistics.fmean(minutes) if minutes else None
    in_time = mean_minutes is not None and mean_minutes <= GRPO_MINUTES
    gain = statistics.fmean(gains)
    return {
        "seeds": [g["seed"] for g, _ in pairs],
        "gain": gain,
        "gain_per_seed": gains,
        "train_minutes": mean_minutes,
        "met": gain >= GRPO_4_CHUNK_GAIN and in_time,
    }


def _best_over_grpo(arms: dict[str, Any]) -> dict[str, Any] | None:
    """The credit arm of highest mean EM among those with two or more seeds, against plain GRPO's seeds."""
    candidates = [a for a, e in arms.items() if a not in REFERENCES and len(e["seeds"]) >= 2]
    if "grpo" not in arms or not candidates:
        return None
    best = max(candidates, key=lambda a: arms[a]["exact_match"])
    arm, grpo = arms[best], arms["grpo"]
    gain, apart = arm["exact_match"] - grpo["exact_match"], arm["exact_match_min"] > grpo["exact_match_max"]
    met = gain >= BEST_OVER_GRPO and apart
    return {"arm": best, "seeds": arm["seeds"], "gain": gain, "outside_seed_spread": apart, "met": met}


def _retention(results: list[dict]) -> dict[str, dict[str, Any]]:
    """Per trained arm: the range (max - min) of its seed-mean EM over the answer positions that held at
    least ``MIN_POSITION_TASKS`` held-out tasks, and first minus last of those positions."""
    readings = {}
    for arm in dict.fromkeys(r["arm"] for r in results if r["arm"] != "base"):
        runs = [r for r in results if r["arm"] == arm]
        tasks = {k: v["tasks"] for k, v in runs[0].get("by_answer_position", {}).items()}
        means = _seed_means(runs, "by_answer_position")
        kept = [k for k in means if tasks.get(k, 0) >= MIN_POSITION_TASKS]
        if len(kept) >= 2:
            curve = [means[k] for k in kept]
            spread = max(curve) - min(curve)
            met = spread <= RETENTION_SPREAD
            readings[arm] = {"positions": kept, "spread": spread, "first_minus_last": curve[0] - curve[-1], "met": met}
    return readings


def target_readings(results: list[dict], arms: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's three targets read from the finished runs (None: not measurable yet)."""
    return {
        "grpo_4_chunk_gain": _grpo_4_chunk_gain(results),
        "best_over_grpo": _best_over_grpo(arms),
        "retention": _retention(results),
    }


def plot(arms: dict[str, Any], out: Path) -> None:
    """``ablation_em.png`` (mean held-out EM per arm, bars from the worst to the best seed) and ``retention.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(arms)
    mean = [100 * arms[a]["exact_match"] for a in names]
    low = [m - 100 * arms[a]["exact_match_min"] for m, a in zip(mean, names)]
    high = [100 * arms[a]["exact_match_max"] - m for m, a in zip(mean, names)]
    fig, ax = plt.subplots(figsize=(max(5, len(names) * 0.8), 4))
    ax.bar(names, mean, yerr=[low, high], capsize=4, color="tab:blue")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title("Held-out EM per arm (bars: seed min-max)")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(out / "ablation_em.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in names:
        curve = arms[arm]["by_answer_position"]
        ax.plot([int(p) for p in curve], [100 * v for v in curve.values()], marker="o", label=arm)
    ax.set_xlabel("position of the chunk that held the answer (1 = first)")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title("Retention curve")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "retention.png", dpi=110)
    plt.close(fig)
    plot_paired(arms, out, plt)


def plot_paired(arms: dict[str, Any], out: Path, plt: Any) -> None:
    """``paired.png``: each arm's EM difference from plain GRPO on the same (seed, task) pairs, 95% interval."""
    rows = [(arm, entry["paired"]["vs_grpo"]) for arm, entry in arms.items() if "vs_grpo" in entry.get("paired", {})]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 1.6 + 0.5 * len(rows)))
    for y, (_, d) in enumerate(rows):
        mean, low, high = (100 * d[k] for k in ("mean_difference", "ci_low", "ci_high"))
        ax.errorbar(mean, y, xerr=[[mean - low], [high - mean]], fmt="o", capsize=4, color="tab:blue")
        ax.annotate(f"p={d['sign_test_p']:.2g}", (high, y), xytext=(4, 0), textcoords="offset points", va="center")
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(range(len(rows)), [arm for arm, _ in rows])
    ax.margins(x=0.25, y=0.3)
    ax.set_xlabel("held-out EM minus plain GRPO's (points)")
    ax.set_title("Paired difference on the same seeds and tasks (95% task bootstrap)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "paired.png", dpi=110)
    plt.close(fig)


def finished_runs(out: Path, order: list[str]) -> list[dict]:
    """Every finished run under ``out`` (earlier invocations' too), arms in ``order`` (others last), then by seed."""
    results = [json.loads(p.read_text()) for p in out.glob("*_seed*/result.json")]
    rank = {arm: i for i, arm in enumerate(order)}
    return sorted(results, key=lambda r: (rank.get(r["arm"], len(order)), r["arm"], r["seed"]))


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def _paired_cell(entry: dict[str, Any]) -> str:
    d = entry.get("paired", {}).get("vs_grpo")
    if d is None:
        return "—"
    low, high = 100 * d["ci_low"], 100 * d["ci_high"]
    return (
        f"{100 * d['mean_difference']:+.1f} [{low:+.1f}, {high:+.1f}], "
        f"{d['wins']}/{d['losses']}, p={d['sign_test_p']:.2g} ({d['pairs']} pairs)"
    )


def _met(reading: dict[str, Any]) -> str:
    return "met" if reading["met"] else "not met"


def targets_text(targets: dict[str, Any]) -> str:
    """The targets' readings as markdown lines (numbers in EM points)."""
    lines = ["Targets, read from the runs above:", ""]
    grpo_target = f"plain GRPO {100 * GRPO_4_CHUNK_GAIN:+.0f} on 4-chunk tasks within {GRPO_MINUTES:.0f} min"
    best_target = f"best credit arm {100 * BEST_OVER_GRPO:+.0f} over plain GRPO, outside the seed spread"
    g = targets["grpo_4_chunk_gain"]
    if g is None:
        lines.append(f"- {grpo_target}: not measurable (needs base and grpo of a seed)")
    else:
        seeds = " / ".join(f"{100 * v:+.1f}" for v in g["gain_per_seed"])
        minutes = "—" if g["train_minutes"] is None else f"{g['train_minutes']:.0f}"
        lines.append(f"- {grpo_target}: {100 * g['gain']:+.1f} (seeds {seeds}), {minutes} min of training: {_met(g)}")
    b = targets["best_over_grpo"]
    if b is None:
        lines.append(f"- {best_target}: not measurable (no credit arm has 2 seeds)")
    else:
        apart = "apart" if b["outside_seed_spread"] else "overlap or touch"
        lines.append(
            f"- {best_target}: {b['arm']} ({len(b['seeds'])} seeds) "
            f"{100 * b['gain']:+.1f}, seed ranges {apart}: {_met(b)}"
        )
    for arm, r in targets["retention"].items():
        lines.append(
            f"- retention flat within {100 * RETENTION_SPREAD:.0f} ({arm}): range {100 * r['spread']:.1f} "
            f"over answer positions {', '.join(r['positions'])} "
            f"(first − last {100 * r['first_minus_last']:+.1f}): {_met(r)}"
        )
    return "\n".join(lines) + "\n"


def summary_table(arms: dict[str, Any]) -> str:
    """The README's markdown table of the summary: one row per arm, held-out EM in percent."""
    rows = [
        "| arm | seeds | held-out EM % (seed min–max) | − plain GRPO, paired: points [95% CI], wins/losses, p "
        "| 4 / 5 / 6 chunks | answer in chunk 1 / 2 / … | 1-hop / 2-hop | memory words | step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, e in arms.items():
        groups = [" / ".join(_pct(v) for v in e[section].values()) for section in SECTIONS]
        spread = f"{_pct(e['exact_match'])} ({_pct(e['exact_match_min'])}–{_pct(e['exact_match_max'])})"
        step = "—" if e["step_time_s"] is None else f"{e['step_time_s']:.1f}"
        seeds = ", ".join(str(s) for s in e["seeds"])
        memory = f"{e['eval_memory_words']:.1f}"
        rows.append(f"| {arm} | {seeds} | {spread} | {_paired_cell(e)} | {' | '.join(groups)} | {memory} | {step} |")
    return "\n".join(rows) + "\n"
