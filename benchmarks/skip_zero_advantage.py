"""Update time with ``grpo.skip_zero_advantage`` off and on, on a batch where half the groups have equal rewards.

    python benchmarks/skip_zero_advantage.py --config configs/memagent/quickstart.yaml --repeats 3
    python benchmarks/skip_zero_advantage.py --config configs/memagent/tiny.yaml --model.init_args.grpo.kl_coef 0

Builds the config's model and data, rolls out ``--tasks`` tasks x ``group_size`` once, gives every
second group equal rewards (advantage exactly 0) and the others distinct ones, then times
``update`` on that batch with the skip off and on, alternating, ``--repeats`` times each after one
warm-up update. The config's KL and entropy settings decide what may be skipped (the quickstart has
neither; further arguments override the config as on the command line). Writes
``benchmarks/results/skip_zero_advantage_<config>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_utils import RESULTS, machine, median, set_threads
from lightning.pytorch.cli import LightningCLI

from lightning_memrl import MemRLDataModule, MemRLModule
from lightning_memrl.advantages import assign_advantages
from lightning_memrl.settings import build_optimizer


def build(config: Path, overrides: list[str]) -> tuple[MemRLModule, MemRLDataModule]:
    """The config's module (its model loaded, an optimizer attached) and data module, without a trainer run."""
    cli = LightningCLI(
        MemRLModule,
        MemRLDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["--config", str(config), *overrides],
        run=False,
        save_config_callback=None,
    )
    module, data = cli.model, cli.datamodule
    module.configure_model()
    data.setup("fit")
    configured = build_optimizer(module.optim, module.policy.parameters(), [], None, None)
    module.optimizers = lambda: configured["optimizer"]
    module.lr_schedulers = lambda: configured["lr_scheduler"]["scheduler"]
    module.manual_backward = lambda loss: loss.backward()
    return module, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/memagent/quickstart.yaml", help="config to time")
    parser.add_argument("--tasks", type=int, default=4, help="tasks in the batch (every second group all-equal)")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per setting")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args, overrides = parser.parse_known_args()
    set_threads(args.threads)
    config = Path(args.config).resolve()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the config's loggers and checkpoint folders stay out of the checkout
        try:
            module, data = build(config, overrides)
        finally:
            os.chdir(cwd)
    group = module.grpo.group_size
    torch.manual_seed(0)
    tasks = [t for t in data.train_tasks[: args.tasks] for _ in range(group)]
    rollouts = module.rollout(tasks, module.generation)
    rollouts.rewards = torch.tensor([1.0 if k // group % 2 else float(k % 2) for k in range(len(tasks))])
    assign_advantages(rollouts, module.advantage)
    base = module.grpo
    times: dict[str, list[float]] = {"off": [], "on": []}
    stats: dict[str, dict[str, float]] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, skip in (("off", False), ("on", True)):
            module.grpo = dataclasses.replace(base, skip_zero_advantage=skip)
            start = time.perf_counter()
            stats[name] = module.update(rollouts)
            if repeat:
                times[name].append(time.perf_counter() - start)
    result = {
        "config": " ".join([str(args.config), *overrides]),
        "rows": rollouts.response_ids.shape[0],
        "tokens": float(rollouts.response_mask.sum()),
        "skipped_rows": stats["on"]["skipped_rows"],
        "skipped_tokens": stats["on"]["skipped_tokens"],
        "update_s_off": median(times["off"]),
        "update_s_on": median(times["on"]),
        "update_s_off_all": times["off"],
        "update_s_on_all": times["on"],
        "machine": machine(args.threads),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"skip_zero_advantage_{config.stem}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2), file=sys.stdout)


if __name__ == "__main__":
    main()
