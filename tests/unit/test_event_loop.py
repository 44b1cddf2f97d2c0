"""kvserve.event_loop: uvloop when installed and wanted, asyncio's loop otherwise."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from kvserve import envs, event_loop


async def _loop_name_and(value: int) -> tuple[str, int]:
    await asyncio.sleep(0)
    return event_loop.running_loop_name(), value


def test_run_uses_uvloop_by_default():
    pytest.importorskip("uvloop")
    assert event_loop.uvloop_wanted()
    assert event_loop.run(_loop_name_and(7)) == ("uvloop", 7)


def test_the_switch_gives_asyncios_loop(monkeypatch):
    monkeypatch.setattr(envs, "KVSERVE_UVLOOP", False)
    assert not event_loop.uvloop_wanted()
    assert event_loop.run(_loop_name_and(3)) == ("asyncio", 3)


def test_without_uvloop_installed_asyncios_loop_runs(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert not event_loop.uvloop_wanted()
    assert event_loop.run(_loop_name_and(1)) == ("asyncio", 1)


@pytest.mark.parametrize(("value", "expected"), [("0", "asyncio"), ("1", "uvloop")])
def test_the_switch_is_read_from_the_environment(value, expected):
    if expected == "uvloop":
        pytest.importorskip("uvloop")
    code = ("import asyncio\nfrom kvserve import event_loop\n"
            "async def name():\n    return event_loop.running_loop_name()\n"
            "print(event_loop.run(name()))")
    env = {**os.environ, "KVSERVE_UVLOOP": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
