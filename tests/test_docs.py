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
