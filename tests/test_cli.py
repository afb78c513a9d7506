"""The command line's defaults: a server refuses what it cannot serve in time, offline runs never refuse."""

from __future__ import annotations

import argparse

import pytest

from loraserve import cli
from loraserve.config import SchedulerConfig


def scheduler_of(monkeypatch, *argv: str) -> SchedulerConfig:
    """The scheduler settings `loraserve ARGV` would run with."""
    parsed: list[argparse.Namespace] = []
    for command in ("_serve", "_cluster", "_generate"):
        monkeypatch.setattr(cli, command, parsed.append)
    cli.main(list(argv))
    return cli._engine_config(parsed[0]).scheduler


@pytest.mark.parametrize("command", ["serve", "cluster"])
def test_a_server_has_slo_targets_by_default_and_off_restores_plain_queueing(monkeypatch, command):
    default = scheduler_of(monkeypatch, command)
    assert (default.ttft_slo, default.tpot_slo, default.queue_slo) == cli.SLO_PRESETS["chat"]
    assert all(target is not None for target in cli.SLO_PRESETS["chat"])
    off = scheduler_of(monkeypatch, command, "--slo", "off")
    assert (off.ttft_slo, off.tpot_slo, off.queue_slo) == (None, None, None)
    chosen = scheduler_of(monkeypatch, command, "--ttft-slo", "2.5")
    assert (chosen.ttft_slo, chosen.tpot_slo) == (2.5, default.tpot_slo), "a flag overrides its preset's target"


def test_offline_generation_refuses_nothing_by_default(monkeypatch):
    default = scheduler_of(monkeypatch, "generate", "Hi")
    assert (default.ttft_slo, default.tpot_slo, default.queue_slo) == (None, None, None)
