"""scripts/gpu_check.py's engine sections (graphs, matrix, bench, pytest) run on the CPU in its dry run:
tiny shapes, the static steps standing in for CUDA graphs, the twin for the kernel; the JSON they write
has what the device run's will have. (The kernel's sections' dry run: tests/test_kernel_build.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_gpu_check_engine_sections_dry_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out),
                           "--sections", "environment,build,graphs,matrix,bench,pytest"],
                          capture_output=True, text=True, timeout=1500)
    assert out.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert proc.returncode == 0 and data["all_ok"], proc.stdout[-6000:] + proc.stderr[-4000:]
    sections = data["sections"]
    assert list(sections) == ["environment", "build", "graphs", "matrix", "bench", "pytest"]  # in the run's order
    assert all(s["ok"] and s["budget_s"] > 0 for k, s in sections.items() if k not in ("environment", "build"))

    graphs = sections["graphs"]
    assert graphs["cases"] and all(c["captured_equal_eager"] for c in graphs["cases"])
    assert set(graphs["step_times"]["modes"]) == {"static", "dynamic"}  # "cuda-graph" too on a GPU

    matrix = sections["matrix"]["cases"]
    assert {c["step_mode"] for c in matrix} == {"static", "dynamic"} and len(matrix) == 8
    assert all(c["prefill_equal"] and c["decode_equal"] and c["verify_bit_identical"] for c in matrix)

    bench = sections["bench"]["report"]
    (shape,) = bench["shapes"]
    assert shape["shape"] == "tiny" and [row["L"] for row in shape["rows"]] == [192, 128]  # the order asked
    assert bench["ok"] and all(row["first_token_equal_recompute"] for row in shape["rows"])
    assert all(len(v) == 3 for row in shape["rows"] for v in row["samples_s"].values())
    assert "| 128 |" in sections["bench"]["table"]

    runs = sections["pytest"]["runs"]  # the GPU tests collected and skipped (no CUDA here)
    assert len(runs) == 2 and all(r["returncode"] == 0 and r["counts"].get("skipped") for r in runs)
    assert not any(r["counts"].get("failed") for r in runs)


def test_gpu_check_keeps_to_its_time_budget(tmp_path):
    """Past the whole budget no section starts: each is listed as skipped, and the run is not all_ok."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget-s", "0.001",
                           "--sections", "environment,build,graphs,bench"], capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text())
    assert proc.returncode == 1 and data["all_ok"] is False
    assert data["sections"]["build"]["ok"]  # always run: the others need it
    for name in ("graphs", "bench"):
        assert data["sections"][name] == {"ok": False, "skipped": "the run's time budget was spent"}
