"""Compile every variant of the Gluon Hopper attention kernel for sm_90 without a GPU (issue 12).

Prints, per variant, schedule and head dim: the wgmma instructions in the PTX, shared memory, and ptxas's
register / spill report (Triton's bundled ptxas, sm_90a). Run with the Triton the H200 has (3.6):

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0 torch diffusers==0.42.1
    /tmp/t36/bin/python benchmarks/gluon_compile_check.py [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from diffusers_trtllm.kernels import gluon_attn  # noqa: E402


def ptxas_report(ptx: str) -> str:
    """Registers and spills as ptxas reports them for sm_90a ('' when Triton ships no ptxas)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    found = re.findall(r"(\d+ bytes spill stores, \d+ bytes spill loads|Used \d+ registers)", text)
    # C7510-C7515: ptxas could not keep wgmma asynchronous (the schedule's overlap is lost)
    found += [f"wgmma SERIALIZED {code}: {why}" for code, why in
              re.findall(r"\((C75\d\d)\)[^\n]*?serialized due to (.{0,48})", text)[:1]]
    return "; ".join(found) if res.returncode == 0 else f"ptxas failed: {text[-500:]}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dump", type=Path, help="write each variant's TTGIR and PTX here")
    args = p.parse_args()
    if gluon_attn.gluon_missing():
        print(gluon_attn.gluon_missing())
        return 1
    print(f"triton {triton.__version__}")
    for variant in gluon_attn.VARIANTS:
        for schedule in gluon_attn.SCHEDULES:
            for head_dim in (64, 128):
                config = replace(gluon_attn.default_config(variant), schedule=schedule)
                kernel = gluon_attn.compile_sm90(variant, head_dim, config)
                ptx = kernel.asm["ptx"]
                wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)[ ;]", ptx))
                print(f"{variant:10s} {schedule:9s} d={head_dim:3d} shared={kernel.metadata.shared:6d} B  "
                      f"{ptxas_report(ptx)}  " + ", ".join(f"{k} x{n}" for k, n in sorted(wgmma.items())))
                if args.dump:
                    args.dump.mkdir(parents=True, exist_ok=True)
                    for ext in ("ttgir", "ptx"):
                        (args.dump / f"gluon_{variant}_{schedule}_d{head_dim}.{ext}").write_text(kernel.asm[ext])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
