"""A run's journal: the tokens rank 0 sampled, so that a restarted rank 0 resumes its run.

Under torchrun the elastic agent restarts the whole worker group when any worker fails,
rank 0 (planner and driver) included; the journal is what survives (docs/recovery.md).
`OUT/journal.jsonl`, one JSON object a line:

    {"journal": 1, "run": "<sha256>", "what": "...", "base": {"3": [17, 4], ...},
     "resumes": [{"attempt": "1", "at": "2026-11-26T06:56:14Z", "tokens": 6, "requests": 4}]}
    {"mb": 12, "t": {"3": 517, "7": 20}}        one line per finished micro-batch
    {"done": true}                                the report was written

The header names the run (`run_id`: a hash of the config, which holds the workload seed,
and the checkpoint path); a journal of another run is refused (`JournalMismatch`), never
replayed. `resumes` lists every attempt that resumed (when, from how many tokens of how
many requests), carried from header to header. `base` holds the tokens the attempt that
wrote the header started from; each micro-batch line adds, per request index (its
position in the workload), the token it sampled, in the order sampled. Each line is written whole and flushed: a process that is
killed loses nothing already written; a machine that crashes can lose the lines since the
last fsync (the header and the done line are synced, the others not), and a line cut
short. Reading stops at the first line that does not parse; what it held is computed
again, which gives the same tokens. A new attempt rewrites the file (header with the new
base, by rename) before it appends, so lines of an attempt never repeat an earlier one's.

Imports nothing but the standard library and `core.errors` (tests/core/test_journal.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from pp_runtime.core.errors import ConfigError

VERSION = 1
NAME = "journal.jsonl"


class JournalMismatch(ConfigError):
    """The journal in the output directory is of another run (or not a journal)."""


def run_id(config: Mapping, checkpoint: str | os.PathLike | None) -> str:
    """What identifies a run: its whole config (workload seed included) and checkpoint path."""
    ckpt = None if checkpoint is None else str(Path(checkpoint).resolve())
    text = json.dumps({"config": config, "checkpoint": ckpt}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Replay:
    """What a journal holds: tokens by request index, and whether its run finished."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    resumes: list[dict] = field(default_factory=list)  # the header's, earlier attempts
    done: bool = False
    lines: int = 0  # micro-batch lines read
    dropped: int = 0  # lines from the first one that did not parse on (not replayed)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.tokens.values()))


def _int_keys(d: Mapping, what: str) -> dict[int, object]:
    if not isinstance(d, dict):
        raise ValueError(f"{what} is not an object")
    return {int(k): v for k, v in d.items()}


def read(path: str | os.PathLike, run: str) -> Replay | None:
    """The journal at path (None if there is none); JournalMismatch if it is another run's."""
    path = Path(path)
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return None
    try:
        head = json.loads(lines[0])
        ok = isinstance(head, dict) and head.get("journal") == VERSION
    except ValueError:
        ok = False
    if not ok:
        raise JournalMismatch(f"{path} is not a pp_runtime journal (version {VERSION}): "
                              "remove it or give another --out")
    if head.get("run") != run:
        raise JournalMismatch(f"{path} is the journal of another run ({head.get('what')}; "
                              f"run {str(head.get('run'))[:12]}, this one {run[:12]}: the "
                              "config, workload seed or checkpoint differ): remove it or "
                              "give another --out")
    out = Replay({i: [int(t) for t in ts] for i, ts in _int_keys(head.get("base", {}),
                                                                    "base").items()},
                 list(head.get("resumes", [])))
    body = lines[1:]
    while body and not body[-1].strip():  # the newline after the last line
        body.pop()
    for n, raw in enumerate(body):
        try:
            _apply(out, json.loads(raw))
        except (ValueError, TypeError, KeyError, AttributeError):
            out.dropped = len(body) - n  # a line cut short, and what follows it
            break
    return out


def _apply(out: Replay, line: dict) -> None:
    if line.get("done") is True:
        out.done = True
        return
    step = {i: int(t) for i, t in _int_keys(line["t"], "t").items()}
    for i, t in step.items():
        out.tokens.setdefault(i, []).append(t)
    out.lines += 1


def resume_tokens(tokens: Mapping[int, Sequence[int]],
                  max_tokens: Sequence[int]) -> dict[int, list[int]]:
    """What to pass as `generated` (by workload index): a request must be left something
    to generate, so one the journal shows complete (max_tokens reached) gives all its
    tokens but the last, which its recompute samples again (same token, one prefill)."""
    out = {}
    for i, ts in tokens.items():
        if not 0 <= i < len(max_tokens):
            raise JournalMismatch(f"journal names request {i}; the workload has "
                                  f"{len(max_tokens)}")
        keep = list(ts[:max_tokens[i] - 1])
        if keep:
            out[i] = keep
    return out


class Journal:
    """Rank 0's writer: the header (with the tokens this attempt starts from), then a line
    per finished micro-batch. `on_microbatch(mb, out)` is the driver's callback."""

    def __init__(self, path: str | os.PathLike, run: str, base: Mapping[int, Sequence[int]],
                 what: str = "", resumes: Sequence[dict] = ()) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        head = {"journal": VERSION, "run": run, "what": what,
                "base": {str(i): list(ts) for i, ts in sorted(base.items())},
                "resumes": list(resumes)}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:  # whole or absent: a new attempt never mixes with the old
            f.write(json.dumps(head, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._f = open(self.path, "a")

    def record(self, mb_id: int, tokens: Mapping[int, int]) -> None:
        """One finished micro-batch's sampled tokens (request index -> token id)."""
        if tokens and self._f is not None:
            line = {"mb": mb_id, "t": {str(i): int(t) for i, t in tokens.items()}}
            self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._f.flush()

    def on_microbatch(self, mb, out) -> None:
        """The driver's callback: the tokens of the sequences that sampled (in a run of
        `run_workload`, a request's id is its workload index)."""
        self.record(mb.mb_id, {s.request_id: out.tokens[s.request_id] for s in mb.seqs
                               if s.sampling is not None})

    def done(self) -> None:
        """The run finished and its report is written: a later start begins afresh."""
        if self._f is not None:
            self._f.write('{"done":true}\n')
            self._f.flush()
            os.fsync(self._f.fileno())
            self.close()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
