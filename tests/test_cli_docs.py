"""docs/cli.md holds the command's reference in one place, and its generated part is what
`--help` prints. Run `python tests/test_cli_docs.py` to rewrite that part after a flag changes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tunix_nb import cli, config_flags
from tunix_nb.train import config as train_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
GENERATED = re.compile(r"(<!-- begin --help -->\n)(.*?)(<!-- end --help -->)", re.S)


def generated_part() -> str:
    return GENERATED.search(DOC.read_text()).group(2)


def test_the_doc_shows_what_help_prints():
    assert generated_part() == cli.help_reference(), "docs/cli.md is stale: run `python tests/test_cli_docs.py`"


def test_every_flag_is_in_the_flag_table():
    """Each config field's flag appears in the hand-written table above the generated part."""
    table = DOC.read_text().split("<!-- begin --help -->")[0]
    classes = [*cli.METHOD_CONFIGS.values(), cli.gkd.GKDConfig, cli.lora.LoRAConfig,
               *(cls for cls, _, _ in train_config.SHARED_OPTIONS)]
    flags = {config_flags.flag_name(f.name) for cls in classes for f in config_flags.option_fields(cls)}
    missing = sorted(flag for flag in flags if f"`{flag}" not in table)
    assert not missing, f"docs/cli.md's table does not explain {missing}"


def test_the_readme_points_to_the_reference_and_does_not_repeat_it():
    readme = (DOC.parent.parent / "README.md").read_text()
    assert "(docs/cli.md)" in readme and "| flag | meaning (default) |" not in readme


if __name__ == "__main__":  # rewrite the generated part
    text = DOC.read_text()
    DOC.write_text(GENERATED.sub(lambda m: m.group(1) + cli.help_reference() + m.group(3), text))
    sys.exit(0)
