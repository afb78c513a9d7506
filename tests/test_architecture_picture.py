"""docs/architecture.svg is drawn from the code (docs/draw_architecture.py): it shows every adapter state
the engine has, so a state added without redrawing the picture fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loraserve.lora.adapter_state import AdapterState

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_committed_picture_shows_every_adapter_state():
    picture = (DOCS / "architecture.svg").read_text()
    assert all(state.value.upper() in picture for state in AdapterState)


def test_the_script_draws_the_picture(tmp_path):
    drawn = tmp_path / "architecture.svg"
    subprocess.run([sys.executable, str(DOCS / "draw_architecture.py"), str(drawn)], check=True, timeout=120)
    assert all(state.value.upper() in drawn.read_text() for state in AdapterState)
