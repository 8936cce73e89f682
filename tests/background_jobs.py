"""The suite's slow single-core child processes, started when collection ends (``conftest.py``) rather than when
their test comes: on a 2-core machine they then run on the core the test process leaves free (the sage-sm90
ptxas build takes about 2 minutes, the interpreter cases most of one), beside the other tests instead of
after them. They run one at a time, so that with the test process two processes share the two cores."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Finished:
    returncode: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    workdir: Path  # the job's own folder, for the files it writes


class BackgroundJob:
    """``command(workdir)`` in a child process (``None``: nothing to run here), for the tests of its module
    named in ``tests``: started in turn (``start_in_turn``) when collection selects one of them, or at once by
    the first ``result``. Its output goes to files, so a full pipe never stalls it."""

    _lock = threading.Lock()
    _started: list[BackgroundJob] = []
    _stopped = False

    def __init__(self, command: Callable[[Path], list[str] | None], tests: tuple[str, ...], **popen):
        self.command, self.tests, self.popen = command, tests, popen
        self.proc: subprocess.Popen | None = None
        self.workdir: Path | None = None

    def start(self) -> None:
        with BackgroundJob._lock:
            if self.workdir is not None or BackgroundJob._stopped:
                return
            self._dir = tempfile.TemporaryDirectory(prefix="background-job-")
            self.workdir = Path(self._dir.name)
            args = self.command(self.workdir)
            if args is None:
                return
            self.started = time.monotonic()
            with open(self.workdir / "stdout", "w") as out, open(self.workdir / "stderr", "w") as err:
                # A session of its own: stop() ends its children too (nvcc's cicc and ptxas).
                self.proc = subprocess.Popen(args, stdout=out, stderr=err, text=True, start_new_session=True,
                                             **self.popen)
            BackgroundJob._started.append(self)

    def result(self, timeout: float | None = None) -> Finished:
        """Waits until the child ends, or kills it ``timeout`` seconds after it started."""
        self.start()
        assert self.proc is not None, "nothing to run here: the test should have skipped"
        try:
            self.proc.wait(None if timeout is None else max(0.0, self.started + timeout - time.monotonic()))
            code = self.proc.returncode
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        return Finished(code, *((self.workdir / f).read_text() for f in ("stdout", "stderr")), self.workdir)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    @staticmethod
    def start_in_turn(jobs: list[BackgroundJob]) -> None:
        """Each job once the one before has ended, from a thread (a test that needs a job first starts it)."""
        def run():
            for job in jobs:
                job.start()
                if job.proc is not None:
                    job.proc.wait()

        threading.Thread(target=run, daemon=True).start()

    @classmethod
    def stop_all(cls) -> None:
        """At the session's end: no child outlives the run (one whose test was deselected or never reached)."""
        with cls._lock:
            cls._stopped = True
        for job in cls._started:
            job.stop()
