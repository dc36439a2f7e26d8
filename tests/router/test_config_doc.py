"""docs/configuration.md is generated from the typed config structs and must equal what they give
now: a field added, renamed, re-defaulted or re-documented without regenerating fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from router.config import RouterConfig
from router.configdoc import default_text, main, one_line, render, tables

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def test_the_committed_page_is_what_the_code_generates() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is out of date: python -m router.configdoc > docs/configuration.md"
    )


def test_every_leaf_key_has_one_row_with_type_default_and_doc() -> None:
    rows = [r for _, section in tables() for r in section]
    keys = [r[0].strip("`") for r in rows]
    assert len(keys) == len(set(keys))
    for key, kind, default, _choices, doc in rows:
        assert kind and default.startswith("`") and doc, key
    for must in (
        "block_size",
        "server.port",
        "policy.load_weight",
        "backends[].url",
        "pd.min_uncached_tokens",
    ):
        assert must in keys
    assert not any(k in keys for k in ("server", "backends", "index.subscriber", "health.breaker"))


def test_choices_and_defaults_come_from_the_types() -> None:
    rows = {r[0].strip("`"): r for _, section in tables() for r in section}
    assert rows["policy.name"][3] == ", ".join(
        f"`{p}`" for p in ("kv", "round_robin", "least_loaded", "random")
    )
    assert rows["backends[].role"][3]
    assert rows["backends[].name"][2] == "`required`"
    assert rows["tokenizer"][2] == "`none`"
    assert rows["policy.load_weight"][2] == f"`{RouterConfig().policy.load_weight!r}`"
    assert rows["server.access_log"][2] == "`false`"


def test_one_line_is_the_first_sentence_escaped_for_a_table() -> None:
    assert one_line("A thing, e.g. this one.\n    Then more. And more.") == "A thing, e.g. this one."
    assert one_line("kv | round_robin.") == "kv \\| round_robin."
    assert one_line("Uses ``x`` here") == "Uses `x` here"


def test_a_field_without_a_docstring_is_named() -> None:
    class Bare(msgspec.Struct):
        documented: int = 1
        """Documented."""
        bare: str = "x"

    with pytest.raises(ValueError, match=r"Bare\.bare \(bare\)"):
        tables(Bare)
    assert default_text(msgspec.structs.fields(Bare)[1]) == '"x"'


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("Listen port.", "Listen port, changed."))
    assert main(["--check", str(stale)]) == 1
    assert main(["--check", str(DOC)]) == 0
    out = subprocess.run(
        [sys.executable, "-m", "router.configdoc"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out == DOC.read_text()
