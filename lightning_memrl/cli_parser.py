"""``MemRLCLI``: Lightning's CLI, with a run's outputs under ``trainer.default_root_dir``, checked
``--ckpt_path`` model options, and options that do nothing in a GRPO run refused with what to set instead.

- Loggers without ``save_dir`` and ``ModelCheckpoint`` without ``dirpath`` follow
  ``trainer.default_root_dir`` (:func:`lightning_memrl.run_outputs.fill_output_dirs`); a run that
  fails before its first step leaves no empty ``version_N`` folder
  (:func:`~lightning_memrl.run_outputs.prune_failed_run`).
- ``--ckpt_path`` with model options that differ from the checkpoint's: see :mod:`lightning_memrl.ckpt_options`.
- Lightning's ``--optimizer``/``--lr_scheduler`` and ``trainer.gradient_clip_val``/``accumulate_grad_batches``
  stop with one message naming the option that does the job here.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memrl import ckpt_options, run_outputs
from lightning_memrl.errors import ConfigError

# commands that ``lightning-memrl`` runs itself, before the parser; listed in ``--help`` next to the Trainer's
EXTRA_COMMANDS = {
    "plot": "PNG learning curves and a before/after evaluation chart of run folders (plot --help).",
    "export": "a checkpoint as a Hugging Face folder: LoRA adapters, or the merged/full model (export --help).",
}
# Lightning's top-level options that a GRPO run does not use -> what to set instead
NOT_OPTIONS = {
    "optimizer": "the optimizer is AdamW, set by model.init_args.optimizer (lr, weight_decay, betas, warmup_steps, "
    "schedule), e.g. --model.init_args.optimizer.lr 1e-4",
    "lr_scheduler": "the learning-rate schedule is set by model.init_args.optimizer (warmup_steps; schedule: "
    "constant | cosine)",
}
# Trainer options that GRPO's own update replaces -> (their no-op value, what to set instead)
REPLACED_TRAINER_OPTIONS = {
    "gradient_clip_val": (None, "GRPO clips gradients in its own update: set model.init_args.grpo.max_grad_norm"),
    "gradient_clip_algorithm": (None, "GRPO clips by global norm: set model.init_args.grpo.max_grad_norm"),
    "accumulate_grad_batches": (
        1,
        "one rollout batch is one optimizer step, its gradients accumulated over micro-batches: set "
        "model.init_args.grpo.micro_batch_tokens (padded tokens per forward/backward) to bound memory, "
        "data.init_args.batch_size for a larger batch",
    ),
}


def check_not_options(argv: list[str]) -> None:
    """Raise :class:`ConfigError` for a command-line ``--optimizer``/``--lr_scheduler`` (or ``--optimizer.lr``...)."""
    for token in argv:
        name = str(token).split("=", 1)[0]
        for option, instead in NOT_OPTIONS.items():
            if name == f"--{option}" or name.startswith(f"--{option}."):
                raise ConfigError(f"{name} is not an option of lightning-memrl: {instead}")


def check_replaced_options(config: Any) -> None:
    """Raise :class:`ConfigError` naming the first option of ``config`` (a subcommand's) that GRPO replaces."""
    for option, instead in NOT_OPTIONS.items():
        if config.get(option) is not None:
            raise ConfigError(f"{option} is not an option of lightning-memrl: {instead}")
    trainer = config.get("trainer") or {}
    for option, (no_op, instead) in REPLACED_TRAINER_OPTIONS.items():
        value = trainer.get(option, no_op)
        if value != no_op:
            raise ConfigError(f"trainer.{option} ({value!r}) is not used by lightning-memrl: {instead}")


class MemRLCLI(LightningCLI):
    """``LightningCLI`` for :class:`~lightning_memrl.MemRLModule` runs (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_configure_optimizers", False)  # the module builds its own optimizer
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Keep ``optimizer``/``lr_scheduler`` as keys that a config file may not set, each naming what to set."""
        for option, instead in NOT_OPTIONS.items():
            parser.add_argument(f"--{option}", type=Any, default=None, help=f"Not used: {instead}.")

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        for name, description in EXTRA_COMMANDS.items():  # for --help only: main() runs them before parsing
            parser._subcommands_action.add_subcommand(
                name, LightningArgumentParser(description=description), help=description
            )

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Refuse ``--optimizer``/``--lr_scheduler``; parse; fill unset output folders; then validate.

        Validation waits for the folders: a logger's ``save_dir`` is a required argument.
        """
        argv = sys.argv[1:] if args is None else args
        if not isinstance(argv, (list, tuple)):  # a dict or Namespace: Lightning parses it as given
            super().parse_arguments(parser, args)
            return
        check_not_options(list(argv))
        self.config = parser.parse_args(argv, _skip_validation=True)
        subcommand = self.config.get("subcommand")
        section = self.config.get(subcommand) if subcommand else self.config
        if section.get("trainer") is not None:
            run_outputs.fill_output_dirs(section.trainer)
        try:
            parser.validate(self.config)
        except (TypeError, KeyError) as err:  # as parse_args reports them: usage and the message, exit 2
            parser.error(str(err), err)

    def _parse_ckpt_path(self) -> None:
        """Lightning applies the checkpoint's model options; check the given ones against them instead."""
        subcommand = self.config.get("subcommand")
        section = self.config.get(subcommand) if subcommand else None
        if section is None or not section.get("ckpt_path") or section.get("model") is None:
            super()._parse_ckpt_path()
            return
        given = section.model.clone()
        super()._parse_ckpt_path()
        found = ckpt_options.conflicts(given, self.config[subcommand].model)
        warning = ckpt_options.check_conflicts(found, section.ckpt_path, subcommand)
        if found:
            self.config[subcommand]["model"] = given
            rank_zero_warn(warning)

    def before_instantiate_classes(self) -> None:
        """Refuse options GRPO replaces; check ``--ckpt_path last`` as a path is checked."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        check_replaced_options(config)
        if config.get("ckpt_path") == "last":
            self._check_last_checkpoint()

    def _check_last_checkpoint(self) -> None:
        """``--ckpt_path last``: check the given model options against the checkpoint it names, as for a path."""
        section = self.config[self.subcommand]
        found = run_outputs.last_checkpoint(section.trainer)
        if found is None:
            return
        section["ckpt_path"] = str(found)
        try:
            self._parse_ckpt_path()
        finally:
            self.config[self.subcommand]["ckpt_path"] = "last"

    def _run_subcommand(self, subcommand: str) -> None:
        before = run_outputs.run_folders(self.trainer.loggers)
        try:
            super()._run_subcommand(subcommand)
        except BaseException as err:  # SIGTERM saved a checkpoint to resume from: its logs stay
            if not isinstance(err, SIGTERMException) and self.trainer.is_global_zero:
                run_outputs.prune_failed_run(before, self.trainer.global_step)
            raise
