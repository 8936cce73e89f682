"""Register hazards of asynchronous wgmma in a cubin's SASS (a test helper; needs ``cuobjdump``).

ptxas may reuse the registers of a product (QGMMA: its A fragment and its accumulator; IGMMA: its accumulator) for other
values while the product still runs, which gives wrong results without any warning (it did so for the
``sage-sm90`` overlap build). This walks every path from the end of each such commit group (the one
marked ``gsb0``) to the first wait that retires it and lists the non-wgmma instructions on it that write
one of the group's registers. Groups retire in order: ``WARPGROUP.DEPBAR.LE gsb0, N`` retires every group
but the N committed last, so it retires this one once N or more groups have been committed after it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

_FUNCTION = re.compile(r"\s+Function : (\w+)")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s*(.*?)\s*;")
_QGMMA = re.compile(r"QGMMA\.64x(\d+)x32\S* R(\d+), R(\d+),")
_IGMMA = re.compile(r"IGMMA\.64x(\d+)x32\S* R(\d+), gdesc")  # Q.K^T: A from shared memory, int32 accumulator
_WRITE = re.compile(r"(?:@!?U?P\w+ )?([A-Z][\w.]*) R(\d+)[, ]")
_BRANCH = re.compile(r"(@!?U?P\w+ )?BRA(?:\.\w+)* (?:\S+, )?0x([0-9a-f]+)")
_NOT_A_WRITE = ("QGMMA", "IGMMA", "HGMMA", "ST", "BAR", "SYNCS", "WARPGROUP")
_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)")
_MAX_PENDING = 8  # more groups in flight than a wait can name: counting further changes nothing


def _width(opcode: str) -> int:
    """Registers an instruction writes from its first destination (``LDS.128``: four, ``IMAD.WIDE``: two)."""
    if ".128" in opcode:
        return 4
    return 2 if ".64" in opcode or ".WIDE" in opcode else 1


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, else the copy Triton ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def cubin_sass(cuobjdump: str, cubin: Path) -> dict[str, list[tuple[int, str]]]:
    """Each kernel's (address, instruction) list, in listing order (one ``cuobjdump`` for the whole cubin)."""
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, list[tuple[int, str]]] = {}
    code: list[tuple[int, str]] = []
    for line in text.splitlines():
        if (name := _FUNCTION.match(line)) is not None:
            code = kernels.setdefault(name.group(1), [])
        elif m := _INSTRUCTION.match(line):
            code.append((int(m.group(1), 16), m.group(2)))
    return kernels


def _group_registers(code: list[tuple[int, str]], end: int, reach: int = 64) -> set[int]:
    """Registers of the products committed at ``end`` (QGMMA: A fragments and accumulators; IGMMA: accumulators): those issued
    since the previous commit, looking back at most ``reach`` instructions."""
    regs: set[int] = set()
    for i in range(end, max(end - reach, -1), -1):
        instruction = code[i][1]
        if i != end and "gsb0" in instruction:
            break
        if m := _QGMMA.match(instruction):
            n, d, a = (int(x) for x in m.groups())
            regs.update(range(a, a + 4), range(d, d + n // 2))
        elif m := _IGMMA.match(instruction):
            n, d = (int(x) for x in m.groups())
            regs.update(range(d, d + n // 2))
    return regs


def _after_commit(code: list[tuple[int, str]], index: dict[int, int], end: int):
    """(instruction, groups committed since) along every path from the group committed at ``code[end]`` to the
    wait that retires it (yielded too), EXIT or RET; a wait that leaves N pending retires it once N followed."""
    seen, todo = set(), [(end + 1, 0)]
    while todo:
        i, later = todo.pop()
        while i < len(code) and (i, later) not in seen:
            seen.add((i, later))
            instruction = code[i][1]
            yield code[i], later
            if ((wait := _WAIT.search(instruction)) and later >= int(wait.group(1), 16)) or instruction.startswith(
                    ("EXIT", "RET")):
                break
            if "GMMA" in instruction and "gsb0" in instruction:
                later = min(later + 1, _MAX_PENDING)
            if b := _BRANCH.match(instruction):
                target = index[int(b.group(2), 16)]
                if b.group(1):  # conditional: both ways
                    todo.append((target, later))
                else:
                    i = target
                    continue
            i += 1


def in_flight_writes(code: list[tuple[int, str]]) -> list[str]:
    """Each instruction that writes a register of a QGMMA or IGMMA group between its commit and the wait that
    retires it."""
    index = {address: i for i, (address, _) in enumerate(code)}
    hazards = []
    for end, (_, instruction) in enumerate(code):
        if not ((_QGMMA.match(instruction) or _IGMMA.match(instruction)) and "gsb0" in instruction):
            continue
        regs = _group_registers(code, end)
        for (address, ins), _ in _after_commit(code, index, end):
            w = _WRITE.match(ins)
            if w and not w.group(1).startswith(_NOT_A_WRITE):
                first = int(w.group(2))
                if regs.intersection(range(first, first + _width(w.group(1)))):
                    hazards.append(f"{address:#x} {ins}")
    return hazards


def pv_runs_past_a_partial_wait(code: list[tuple[int, str]]) -> bool:
    """Whether some P.V product (a QGMMA as wide as the head) is still running after a wait that leaves groups
    pending: the softmax overlap. ptxas loses it when a product under a branch closes a group of its own."""
    index = {address: i for i, (address, _) in enumerate(code)}
    wide = [i for i, (_, ins) in enumerate(code) if (m := _QGMMA.match(ins)) and int(m.group(1)) >= 64]
    ends = {next(i for i in range(start, len(code)) if "gsb0" in code[i][1]) for start in wide}  # one per group
    return any((wait := _WAIT.search(ins)) and later < int(wait.group(1), 16)
               for end in sorted(ends) for (_, ins), later in _after_commit(code, index, end))
