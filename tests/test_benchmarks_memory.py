"""benchmarks/kept_activations.py: the per-block count of what autograd keeps (CPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kept_activations as ka  # noqa: E402


def _units(kind, mode, rows=1024, dim=128):
    return ka.units(ka.kept_storages(ka.block_of(kind, dim, 4, 16), rows, mode), rows, dim)


def test_compiled_logo_block_keeps_less_than_three_units_over_full_attention():
    """The compiled LoGo block (what train.compile runs) keeps less than 3 (rows, dim) bf16 units more than full
    attention's compiled block: one bf16 copy of the block input serves the projections and the gate, and the
    branch inputs are recomputed in the backward (three copies of the input plus the gate's fp32 input, or kept
    branch inputs, would each add several units)."""
    full = _units("full", "block")
    logo = _units("logo", "block")
    assert 0 < logo - full < 3.0, (full, logo)


def test_cli_table_and_bad_kind(capsys):
    ka.main(["--kinds", "full", "--modes", "eager", "--rows", "64", "--dim", "32", "--heads", "2", "--list"])
    out = capsys.readouterr().out
    assert "| full | eager |" in out and "bfloat16" in out
    with pytest.raises(SystemExit):
        ka.main(["--kinds", "fulll"])
    assert "unknown ['fulll']" in capsys.readouterr().err
