"""The fault seam's load hooks (engine/faults.py), read from the environment as a server
process reads them: off by default; the gate holds the load until its file exists."""
from __future__ import annotations

import threading

from pagedllm.engine.faults import Faults


def test_no_hook_is_on_unless_asked_for(monkeypatch):
    for name in ("PAGEDLLM_TEST_FAIL_SAMPLING_SEED", "PAGEDLLM_TEST_BREAK_ENGINE",
                 "PAGEDLLM_TEST_LOAD_DELAY", "PAGEDLLM_TEST_LOAD_GATE"):
        monkeypatch.delenv(name, raising=False)
    assert Faults.from_env() == Faults()
    Faults.from_env().hold_load()  # returns at once


def test_the_gate_holds_the_load_until_its_file_exists(monkeypatch, tmp_path):
    gate = tmp_path / "gate"
    monkeypatch.setenv("PAGEDLLM_TEST_LOAD_GATE", str(gate))
    faults = Faults.from_env()
    assert faults.load_gate == str(gate)
    loaded = threading.Event()
    loader = threading.Thread(target=lambda: (faults.hold_load(), loaded.set()), daemon=True)
    loader.start()
    assert not loaded.wait(0.5)  # held
    gate.touch()
    assert loaded.wait(30)
