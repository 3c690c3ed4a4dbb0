"""Finished tasks on disk, so that a run killed half-way continues where it stopped.

A resume directory holds ``job.json`` (what the tasks belong to: model, data, hardware, settings, task count)
and one ``task-NNNNNN.json`` per finished task, written by the driver as each result arrives (to a temporary
name, then renamed: a kill never leaves half a file under a task's name). A rerun with the same directory
loads the finished tasks and runs only the others; a directory made for other work is refused, naming what
differs, rather than mixing results.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import NpuError

JOB = "job.json"
FORMAT = 1


class ShardStore:
    def __init__(self, directory: str | Path, fingerprint: dict):
        self.directory = Path(directory)
        self.fingerprint = json.loads(json.dumps({"format": FORMAT, **fingerprint}))  # as it reads back
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            job = self.directory / JOB
            if job.exists():
                self._check(json.loads(job.read_text()))
            else:
                self._write(job, self.fingerprint)
        except OSError as exc:
            raise NpuError(f"resume directory {self.directory}: {exc.strerror}") from None
        except ValueError:
            raise NpuError(f"resume directory {self.directory}: {JOB} is not valid JSON; use an empty "
                           "directory") from None

    def _check(self, stored) -> None:
        if not isinstance(stored, dict):
            raise NpuError(f"resume directory {self.directory}: {JOB} is not a job description")
        differs = sorted(k for k in {*stored, *self.fingerprint} if stored.get(k) != self.fingerprint.get(k))
        if differs:
            raise NpuError(f"resume directory {self.directory} holds results of other work ({', '.join(differs)} "
                           "differ): use another directory, or empty this one")

    def _path(self, index: int) -> Path:
        return self.directory / f"task-{index:06d}.json"

    @staticmethod
    def _write(path: Path, value) -> None:
        temporary = path.with_name(path.name + ".partial")
        temporary.write_text(json.dumps(value))
        os.replace(temporary, path)

    def finished(self, count: int) -> dict[int, dict]:
        """Results of the tasks ``0 .. count - 1`` already on disk."""
        results = {}
        for index in range(count):
            path = self._path(index)
            try:
                results[index] = json.loads(path.read_text())
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                raise NpuError(f"resume directory {self.directory}: {path.name} is unreadable ({exc}); "
                               "delete it to run that task again") from None
        return results

    def save(self, index: int, result: dict) -> None:
        try:
            self._write(self._path(index), result)
        except OSError as exc:
            raise NpuError(f"resume directory {self.directory}: cannot write {self._path(index).name}: "
                           f"{exc.strerror}") from None
