"""A quiet `dvc repro` for people: a progress bar over the stages DVC plans to run, one line per
stage when it finishes (what it wrote or found, and how long it took), errors as they come, and
every line DVC, the stages and their tools print (the exporter's progress bars, onnxruntime's
quantizer, transformers' notices) in a log file whose path is printed first."""

from __future__ import annotations

import functools
import re
import sys
import time
from pathlib import Path

LOG = Path("logs/build.log")  # under the repository root; git-ignored
# The stages log as "<date> <time> <logger> <LEVEL> <message>" (tasks/core/stage.py); the stage
# module itself (run as __main__) says what it wrote or found.
STAGE_MESSAGE = re.compile(r"^\S+ \S+ __main__ INFO (.*)$")
PROBLEM = re.compile(r"^(error: |ERROR: )")
# A stage's memory estimate (tasks/core/resources.py logs it before work), and DVC's word for a
# stage the kernel killed (SIGKILL: the out-of-memory killer, unless someone ran kill -9).
PREFLIGHT = re.compile(r"preflight: (\S+) needs about (.+?) of memory .*?; (.+?) of memory and")
KILLED = re.compile(r"failed to reproduce '([^']+)'.*exited with -9")
FAILED = re.compile(r"failed to reproduce '([^']+)'")
MESSAGE_WIDTH = 150


class StageLines:
    """Follows DVC's output: which stage runs, since when, and its latest message."""

    def __init__(self, say, warn=None):
        # say: a stage's line; warn: a problem's line (stderr, where a script looks for why it failed)
        self.say, self.warn, self.stage, self.started, self.message = say, warn or say, None, 0.0, ""
        self.estimates: dict[str, tuple[str, str]] = {}  # stage -> (memory needed, memory available)
        self.failed: list[str] = []  # stages that said an error, in order
        self.interrupted = False  # Ctrl-C: the running stage did not finish

    def line(self, text: str) -> None:
        from flows.dvc import STAGE_STARTED

        started = STAGE_STARTED.search(text)
        if started:
            self.finish()
            self.stage, self.started, self.message = started.group(1), time.perf_counter(), ""
            return
        if (estimate := PREFLIGHT.search(text)) is not None:
            self.estimates[estimate.group(1)] = (estimate.group(2), estimate.group(3))
        message = STAGE_MESSAGE.match(text)
        if message:
            self.message = message.group(1)
        elif (killed := KILLED.search(text)) is not None:
            self.warn(self.killed(killed.group(1)))
            self.fail(killed.group(1))
        elif (failed := FAILED.search(text)) is not None and failed.group(1) in self.failed:
            pass  # DVC repeating the error the stage has just said in its own words
        elif PROBLEM.match(text):
            self.warn(text)
            self.fail((failed.group(1) if failed else None) or self.stage)

    def fail(self, stage: str | None) -> None:
        if stage is not None and stage not in self.failed:
            self.failed.append(stage)

    def killed(self, stage: str) -> str:
        """The line for a stage that died of SIGKILL: almost always the out-of-memory killer."""
        line = f"error: {stage} was killed (SIGKILL), most likely by the kernel's out-of-memory killer"
        if stage in self.estimates:
            needed, available = self.estimates[stage]
            return f"{line}: its estimate was about {needed} of memory, with {available} available at its start"
        return f"{line}: give it more memory"

    def finish(self) -> None:
        if self.stage is not None:
            elapsed = time.perf_counter() - self.started
            if self.stage in self.failed:
                message = "failed"
            elif self.interrupted:
                message = "interrupted"
            else:
                message = self.message or "done"
            message = message if len(message) <= MESSAGE_WIDTH else message[: MESSAGE_WIDTH - 1] + "…"
            self.say(f"{self.stage}: {message} ({elapsed:.0f} s)")
            self.stage = None


def reproduce_with_progress(root: Path, targets: list[str] | None = None, *options: str) -> list[str]:
    """Run `dvc repro [options] [targets]` quietly; return the stages executed."""
    from tqdm import tqdm

    from flows.dvc import DvcFailed, planned_stages, reproduce

    try:
        total = len(planned_stages(root, targets, *options))
    except DvcFailed:
        total = None  # a dry run cannot plan stages whose inputs do not exist yet: count without a total
    if total == 0:
        return []
    log = Path(root) / LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(log, "w", encoding="utf-8") as handle,
        tqdm(total=total, unit="stage", dynamic_ncols=True, disable=None) as bar,
    ):
        bar.write(f"full log: {log}")
        stages = StageLines(bar.write, functools.partial(bar.write, file=sys.stderr))

        def follow(text: str) -> None:
            handle.write(text + "\n")
            handle.flush()
            before = stages.stage
            stages.line(text)
            if stages.stage != before and before is not None:
                bar.update(1)
            if stages.stage is not None:
                bar.set_description(stages.stage)

        try:
            ran = reproduce(root, targets, *options, echo=follow)
        except KeyboardInterrupt:
            stages.interrupted = True  # the stage running is not done: the finally below says so
            raise
        except DvcFailed as error:
            if stages.failed:  # the stage's own line has been said: name it, not DVC's echo of it
                raise DvcFailed(f"the build stopped at {', '.join(stages.failed)} (full log: {log})") from None
            raise DvcFailed(f"{error} (full log: {log})") from None
        finally:
            stages.finish()
        bar.update(len(ran) - bar.n)
    return ran
