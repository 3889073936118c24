"""What a run shows and keeps track of while it goes: the live accuracy on the progress bar, and what it
has produced so far, for the message of a run that ends early."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k strict-match, for the live progress display only


class RunningAccuracy:
    """Live strict-match accuracy for the progress bar (the reported numbers come from lm-eval), shown once
    `shown_after` answers are in (before that a first batch's 1.000 says nothing), with the count it is over."""

    def __init__(self, shown_after: int = 100):
        self.correct = self.n = 0
        self.shown_after = shown_after
        self.postfix = {}

    def __call__(self, requests, texts, stats):
        for req, text in zip(requests, texts):
            gold = str(req.doc["answer"]).split("####")[-1].strip().replace(",", "")
            m = STRICT.search(text)
            self.correct += bool(m) and m.group(1).replace(",", "").rstrip(".") == gold
            self.n += 1
        if self.n >= self.shown_after:
            self.postfix = {"acc": f"{self.correct / self.n:.3f} of {self.n}"}


@dataclasses.dataclass
class Progress:
    """What this run has produced so far, for the message of an interrupted run."""

    out: Path | None = None
    models: list = dataclasses.field(default_factory=list)  # every LocalLeapLM this run made
    discarded: bool = False
    made: str = "answers generated"  # what the models' rows are, as the line that says what was kept names them

    @property
    def answers(self) -> int:
        return sum(lm.rows_generated for lm in self.models)

    def flush(self) -> None:
        """Let lm-eval's cache write what it has queued (its writer thread dies with the process)."""
        for lm in self.models:
            db = getattr(lm.cache_hook, "dbdict", None)
            if db is not None:
                try:
                    db.commit(blocking=True)
                except Exception:  # noqa: BLE001  (a cache that cannot commit loses answers the rerun redoes)
                    pass

    def interrupted(self, what: str) -> str:
        if self.out is None or self.discarded:
            return f"interrupted ({what}) before anything was generated; nothing was kept"
        return f"interrupted ({what}): {self.kept()}"

    def kept(self) -> str:
        """What a run that ends now leaves for the next one."""
        if self.out is None or self.discarded:
            return "nothing was kept"
        return (f"kept {self.answers} {self.made} by this run (and all earlier ones) in {self.out / 'cache'}; "
                "rerun the same command to resume")
