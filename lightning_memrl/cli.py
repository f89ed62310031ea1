"""The ``lightning-memrl`` command: LightningCLI with ``fit``, ``validate``, ``test``, ``predict``."""

from __future__ import annotations

import sys
import warnings

import lightning as L

import lightning_memrl  # noqa: F401  (registers MemRLModule, MemRLDataModule)
import lightning_memrl.sft  # noqa: F401  (registers the warm-start stage's classes)
from lightning_memrl.cli_parser import MemRLCLI
from lightning_memrl.errors import ConfigError, find_user_error
from lightning_memrl.export import main as export_main
from lightning_memrl.plot import main as plot_main
from lightning_memrl.preload import maybe_reexec
from lightning_memrl.threads import configure_threads_at_start


def build_cli(args: list[str] | None = None) -> MemRLCLI:
    """Parse ``args`` (default: ``sys.argv``) and run the chosen subcommand; returns the CLI."""
    warnings.filterwarnings("ignore", message=r".*jsonargparse.*deprecat.*", category=DeprecationWarning)
    return MemRLCLI(  # any LightningModule: MemRLModule (GRPO) or lightning_memrl.sft.MemorySFTModule
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main() -> None:
    """Run ``lightning-memrl SUBCOMMAND --config CONFIG.yaml [--key value ...]``.

    ``lightning-memrl plot LOG_DIR`` turns CSV logs and evaluation reports into PNG charts.
    """
    if len(sys.argv) > 1 and sys.argv[1] == "plot":
        plot_main(sys.argv[2:])
        return
    try:
        maybe_reexec(sys.argv)  # fit/validate/test/predict start again under tcmalloc where it is installed
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    configure_threads_at_start()  # torch CPU threads from the CPUs this process may use, unless OMP_NUM_THREADS is set
    if len(sys.argv) > 1 and sys.argv[1] == "export":  # lightning-memrl export CKPT OUT [--merge]
        export_main(sys.argv[2:])
        return
    try:
        build_cli()
    except Exception as err:  # a user's data or config: the message names it; a traceback would bury it
        user_error = find_user_error(err)  # jsonargparse wraps errors raised while it builds the config's objects
        if user_error is None:
            raise
        print(f"error: {user_error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
