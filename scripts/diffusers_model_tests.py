"""Diffusers' own model tests as a regression check: which outcomes change once our processor serves every model.

Runs a Diffusers checkout's tests (``tests/models/transformers/`` by default) twice with the installed
Diffusers: stock, then with ``install(model, TrtllmAttnProcessor())`` on every ``ModelMixin`` the tests build
(right after its construction, so a test that then sets a processor of its own still does), and lists the
tests whose outcome (passed, failed, error, skipped) differs from stock::

    python scripts/diffusers_model_tests.py /path/to/diffusers            # both passes, then the comparison
    python scripts/diffusers_model_tests.py /path/to/diffusers --passes trtllm --paths tests/models/transformers/test_models_transformer_flux.py

The checkout only needs its ``tests/`` at the installed release (``git clone --depth 1 --branch v0.42.1
https://github.com/huggingface/diffusers``); nothing is downloaded (``HF_HUB_OFFLINE=1``). Each pass writes
``<out>/<pass>.json`` (test id -> outcome and the failure's last line); ``--passes`` reruns only some of them
(``--passes`` alone: none) and the comparison reads the others from ``--out``. Exit status: 1 if any outcome differs.

Imported by pytest (``-p diffusers_model_tests``, as the passes do) this module is the plugin that records
outcomes and, with ``DIFFUSERS_TRTLLM_INSTALL=1``, installs the processor.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

#: The environment the plugin reads: where to write outcomes, and whether to install our processor.
OUTCOMES_ENV = "DIFFUSERS_TRTLLM_OUTCOMES"
INSTALL_ENV = "DIFFUSERS_TRTLLM_INSTALL"
PASSES = ("stock", "trtllm")


# ---- the pytest plugin ---------------------------------------------------------------------------------
_outcomes: dict[str, dict[str, str]] = {}
_building = threading.local()


def _serve(model: Any) -> None:
    """``install(model, TrtllmAttnProcessor())`` where the model has an attention module."""
    import diffusers_trtllm

    if any(callable(getattr(m, "processor", None)) for m in model.modules()):
        diffusers_trtllm.install(model, diffusers_trtllm.TrtllmAttnProcessor())


def _wrap_init(cls: type) -> None:
    """Serve a model once its outermost ``__init__`` returns (a model built inside another is served with it)."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_trtllm_serves", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_building, "depth", 0)
        _building.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _building.depth = depth
        if depth == 0:
            _serve(self)

    __init__._trtllm_serves = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _serve_every_model() -> None:
    """Wrap the ``__init__`` of every ``ModelMixin`` class, those defined now and those imported later."""
    from diffusers.models.modeling_utils import ModelMixin

    def subclasses(cls: type) -> list[type]:
        return [cls] + [s for sub in cls.__subclasses__() for s in subclasses(sub)]

    for cls in subclasses(ModelMixin):
        _wrap_init(cls)

    def __init_subclass__(cls, **kwargs):
        super(ModelMixin, cls).__init_subclass__(**kwargs)
        _wrap_init(cls)

    ModelMixin.__init_subclass__ = classmethod(__init_subclass__)


def pytest_configure(config) -> None:
    if os.environ.get(INSTALL_ENV) == "1":
        _serve_every_model()


def pytest_runtest_logreport(report) -> None:
    """A test's outcome over its phases: ``error`` (setup or teardown failed), ``failed``, ``skipped``, ``passed``;
    each test's line is added to ``<outcomes>l`` as it ends, so a pass cut short keeps what it ran."""
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["message"] = _last_line(report.longreprtext)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    path = os.environ.get(OUTCOMES_ENV)
    if path and report.when == "teardown":
        with open(path + "l", "a") as lines:
            lines.write(json.dumps({report.nodeid: entry}) + "\n")


def pytest_collectreport(report) -> None:
    """A test file that cannot be collected (a missing test dependency) counts as one ``error``."""
    if report.failed:
        _outcomes[report.nodeid] = {"outcome": "error", "message": _last_line(report.longreprtext)}


def pytest_sessionfinish(session) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        Path(path).write_text(json.dumps(_outcomes, indent=1, sort_keys=True))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[-1][:300]


# ---- running the passes and comparing them -------------------------------------------------------------
def run_pass(name: str, checkout: Path, paths: list[str], out: Path, pytest_args: list[str]) -> Path:
    """One pytest run over ``paths`` of ``checkout``; returns the outcomes file."""
    outcomes = out / f"{name}.json"
    Path(f"{outcomes}l").unlink(missing_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env[OUTCOMES_ENV] = str(outcomes)
    env[INSTALL_ENV] = "1" if name == "trtllm" else "0"
    command = ["nice", "-n", "10", sys.executable, "-m", "pytest", *paths, "-p", "diffusers_model_tests",
               "-p", "no:cacheprovider", "-q", "-o", "addopts=", "--continue-on-collection-errors", *pytest_args]
    print(f"[{name}] {' '.join(command)}", flush=True)
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(command, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if not outcomes.exists():
        raise SystemExit(f"the {name} pass wrote no outcomes; see {out / f'{name}.log'}")
    return outcomes


def read_outcomes(out: Path, name: str, parser: argparse.ArgumentParser) -> dict[str, dict[str, str]]:
    """A pass's outcomes: its JSON, or the lines of a pass cut short."""
    path = out / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    lines = Path(f"{path}l")
    if not lines.exists():
        parser.error(f"no {path}: run the {name} pass (--passes {name})")
    outcomes: dict[str, dict[str, str]] = {}
    for line in lines.read_text().splitlines():
        outcomes.update(json.loads(line))
    return outcomes


def compare(stock: dict[str, dict[str, str]], ours: dict[str, dict[str, str]]) -> list[tuple[str, str, str, str]]:
    """``(test, stock outcome, our outcome, our failure's last line)`` for every test whose outcome differs."""
    missing = {"outcome": "not run", "message": ""}
    return [(test, stock.get(test, missing)["outcome"], ours.get(test, missing)["outcome"],
             ours.get(test, missing)["message"] or stock.get(test, missing)["message"])
            for test in sorted(set(stock) | set(ours))
            if stock.get(test, missing)["outcome"] != ours.get(test, missing)["outcome"]]


def _counts(outcomes: dict[str, dict[str, str]]) -> str:
    tally: dict[str, int] = {}
    for entry in outcomes.values():
        tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(tally.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a Diffusers checkout (its tests/) at the installed release")
    parser.add_argument("--paths", nargs="+", default=["tests/models/transformers"],
                        help="test paths inside the checkout (default: tests/models/transformers)")
    parser.add_argument("--out", type=Path, default=Path("diffusers_model_tests"),
                        help="where each pass writes <pass>.json and <pass>.log")
    parser.add_argument("--passes", nargs="*", choices=PASSES, default=list(PASSES),
                        help="the passes to run now (the others are read from --out; none: only compare)")
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, one string (e.g. '-k flux')")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    if not (checkout / "tests").is_dir():
        parser.error(f"{checkout} has no tests/ folder: give a Diffusers checkout "
                     "(git clone --depth 1 --branch v<installed version> https://github.com/huggingface/diffusers)")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.passes:
        run_pass(name, checkout, args.paths, args.out.resolve(), args.pytest_args.split())
    results = {name: read_outcomes(args.out, name, parser) for name in PASSES}
    if set(results["stock"]) != set(results["trtllm"]):
        both = set(results["stock"]) & set(results["trtllm"])
        print(f"comparing the {len(both)} tests both passes ran (a pass was cut short)")
        results = {name: {t: e for t, e in outcomes.items() if t in both} for name, outcomes in results.items()}
    for name, outcomes in results.items():
        print(f"{name}: {len(outcomes)} tests: {_counts(outcomes)}")
    differ = compare(results["stock"], results["trtllm"])
    print(f"{len(differ)} tests whose outcome differs from stock")
    for test, stock, ours, message in differ:
        print(f"  {test}: stock {stock}, with TrtllmAttnProcessor {ours}" + (f": {message}" if message else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
