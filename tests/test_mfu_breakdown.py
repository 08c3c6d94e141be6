"""benchmarks/mfu_breakdown.py as a user runs it: one layer's ops by class and Meta's published
Llama 3 405B layout priced by the cost model (the figures of benchmarks/results/llama405b-mfu.md)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layer_split_and_published_layout():
    out = subprocess.run([sys.executable, "benchmarks/mfu_breakdown.py", "--no-tune"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shares = {group: float(share) for group, share in re.findall(r"^\s+(GEMM|attention|elementwise/norm)\s+[\d.]+ ms\s+([\d.]+)%",
                                                                  out.stdout, re.M)}
    assert set(shares) == {"GEMM", "attention", "elementwise/norm"}, out.stdout
    assert abs(sum(shares.values()) - 100.0) < 0.5
    layer_mfu = float(re.search(r"layer MFU ([\d.]+)%", out.stdout).group(1))
    assert 20.0 < layer_mfu < 85.0  # below the GEMMs' own efficiency, above a memory-bound layer
    row = next(line for line in out.stdout.splitlines() if line.startswith("published layout"))
    assert "pp16 tp8 dp128 mb1 G16" in row and row.rstrip().endswith("fits"), row
