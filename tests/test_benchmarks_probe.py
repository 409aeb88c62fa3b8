"""benchmarks/gate_probe.py on CPU: a few steps of each kind, its output, and one-line errors."""
import json
import sys

import pytest
import torch

from conftest import ROOT, run_python

sys.path.insert(0, str(ROOT / "benchmarks"))
import gate_probe  # noqa: E402

sys.path.pop(0)


def test_sequences_put_the_key_after_every_marker():
    x, y, marks = gate_probe.sequences(torch.Generator().manual_seed(0), 8, 128)
    rows = torch.arange(8)[:, None]
    assert x.shape == y.shape == (8, 128) and marks.shape[1] == 8
    assert torch.all(x[rows, marks] == gate_probe.MARKER) and torch.all(y[rows, marks] == x[:, :1])
    assert torch.all(x[:, 0] < gate_probe.KEYS)
    assert torch.all(marks[:, 1:] - marks[:, :-1] > 8)  # beyond the default window of 8 tokens


def test_copy_sequences_repeat_the_span_and_mark_its_copies():
    x, y, marks = gate_probe.copy_sequences(torch.Generator().manual_seed(0), 4, 64)
    rows = torch.arange(4)[:, None]
    assert x.shape == y.shape == (4, 64) and marks.shape == (4, 31)
    assert torch.equal(x[:, 32:], x[:, :32])
    assert torch.equal(y[rows, marks], x[rows, marks - 31])  # the token after the first occurrence
    assert int(marks.min()) == 32 and int(marks.max()) == 62


def test_probe_runs_logs_the_gate_and_reports_held_out_routing(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert gate_probe.main(["--steps", "4", "--log-every", "2", "--layers", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["step"] for r in res["log"]] == [0, 2]
    assert all(0 < r["p_all"] < 1 and 0 <= r["acc_marker"] <= 1 for r in res["log"])
    assert len(res["global_at_markers"]) == len(res["global_overall"]) == 2
    assert 0 <= res["accuracy_at_markers"] <= 1
    assert "held out:" in capsys.readouterr().out
    assert gate_probe.main(["--kind", "full", "--steps", "2"]) == 0  # no gate: accuracy only
    assert "global_overall" not in capsys.readouterr().out
    assert gate_probe.main(["--task", "copy", "--seq-len", "48", "--steps", "2", "--layers", "2"]) == 0
    assert "global_at_markers" in capsys.readouterr().out


@pytest.mark.parametrize("args,needle", [(["--rho", "2"], "attention.rho=2.0"),
                                         (["--steps", "0"], "--steps and --log-every must be >= 1"),
                                         (["--task", "copy", "--seq-len", "41"], "--seq-len 41 must be even"),
                                         (["--task", "nope"], "argument --task: invalid choice: 'nope'")])
def test_bad_arguments_are_one_line_exit_2(args, needle):
    p = run_python([sys.executable, "benchmarks/gate_probe.py", *args], timeout=120)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1
