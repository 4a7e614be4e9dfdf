"""docs/settings.md is generated from the settings classes; it must say what each setting means and
match the classes (run `python scripts/settings_reference.py` after changing one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from modelfleet.controlplane.core.config import Settings
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[1]


def test_settings_page_is_current():
    check = [sys.executable, str(ROOT / "scripts" / "settings_reference.py"), "--check"]
    result = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("settings", [ServerSettings, OperatorSettings, Settings], ids=lambda c: c.__name__)
def test_every_setting_says_what_it_means(settings):
    assert [name for name, field in settings.model_fields.items() if not field.description] == []


def test_every_variable_the_code_reads_by_name_is_on_the_page():
    """Variables read from the environment outside a settings class (the engine's, `NAME_ENV = "..."`)
    are listed too."""
    import re

    sources = "\n".join(path.read_text(encoding="utf-8") for path in (ROOT / "dataplane").rglob("*.py"))
    names = set(re.findall(r'_ENV = "(MODELFLEET_[A-Z_]+)"', sources))
    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert {"MODELFLEET_GRAMMARS", "MODELFLEET_CPU_THREADS"} <= names
    assert sorted(name for name in names if f"`{name}`" not in page) == []
