"""Smoke test on the real embedded target, SmolLM2-135M (2 samples of ShareGPT)."""

from __future__ import annotations

import json

import pytest

from elsi.cli import main


@pytest.mark.slow
def test_analyze_two_samples_of_sharegpt_on_smollm2(tmp_path, capsys):
    run = tmp_path / "smol"
    args = ["analyze", "--samples", "2", "--max-tokens", "256", "--out", str(run)]
    assert main(args) == 0
    res = json.loads((run / "analysis.json").read_text())
    assert res["num_layers"] == 30 and res["hidden_size"] == 576
    assert res["layers"] == list(range(1, 31))
    assert len(res["layer_entropy"]) == 30 and len(res["cka"]) == 31 and len(res["transition"]) == 30
    assert all(0 < h <= 1 for h in res["layer_entropy_normalized"])
    assert res["counts"]["samples_used"] == 2
    man = json.loads((run / "manifest.json").read_text())
    assert man["status"] == "complete" and man["versions"]["torch"]
    capsys.readouterr()
    assert main(args) == 0  # the same command reuses the finished run
    assert "2 samples" in capsys.readouterr().out
    assert main([*args[:-2], "--rho", "0.5", "--out", str(run)]) == 2
