"""The ``moeckpt`` command: a click group; every subcommand lives in its own module under ``moeckpt.cli``."""

from __future__ import annotations

import importlib

import click

from .common import run_main

#: subcommand modules; each defines a click command named ``command`` that is added to the group.
COMMAND_MODULES = (
    "init_cmd",
    "inspect_cmd",
    "verify_cmd",
    "diff_cmd",
    "gc_cmd",
    "demo_cmd",
    "export_hf_cmd",
    "import_hf_cmd",
    "reshard_cmd",
    "train_cmd",
    "eval_cmd",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="moeckpt")
def cli() -> None:
    """Save, reshard and restore Mixture-of-Experts checkpoints (safetensors or zarr, local disk or S3)."""


for _name in COMMAND_MODULES:
    cli.add_command(importlib.import_module(f"{__package__}.{_name}").command)


def main() -> None:
    run_main(cli)


if __name__ == "__main__":
    main()
