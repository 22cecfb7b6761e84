"""Schemas checked in worker processes before the server builds them.

A schema can be built to take seconds (a regex repeated a million times) or to explode inside
llguidance. The server therefore first runs `grammar_check`'s whole build (prepare, matcher,
first mask, probe walk) in a worker process at the lowest CPU priority, and waits at most
`GrammarConfig.max_compile_seconds` for the verdict: at the limit the worker is killed (the
work is cancelled, not checked afterwards) and the request is refused. Only a schema a worker
built within the limit is built again in the server. Workers start on first use (building
the tokenizer takes about a second there, outside the limit) and are replaced when killed.

The protocol is one JSON object a line on the worker's stdin and stdout: first
`{"tokenizer": "module:function", "args": [...], "config": {...}}` (answered `{"ready": true}`),
then `{"schema": text}` per check (answered `{"ok": true}` or `{"error": message}`).
No torch here: a worker imports only this module, `grammar_check` and llguidance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from dspark_serve.verifier.grammar_check import GrammarConfig, GrammarError, build_matcher, prepare

log = logging.getLogger(__name__)
STARTUP_SECONDS = 120.0  # a worker's start (interpreter, llguidance, tokenizer), outside the limit


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, hello: str) -> None:
        # At the lowest CPU priority from its first instruction (interpreter start, imports and
        # the tokenizer included): a killed worker is replaced at once, and a client that keeps
        # sending slow schemas must not buy CPU the engine wants that way.
        nice = shutil.which("nice")
        prefix = [nice, "-n", "19"] if nice else []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "dspark_serve.verifier.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="surrogatepass",
        )
        self._send(hello)
        reply = self._read(STARTUP_SECONDS)
        if reply is None or not reply.get("ready"):
            self.kill()
            raise RuntimeError(f"the grammar worker did not start: {reply!r}")

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self, timeout: float) -> dict[str, Any] | None:
        """The next reply, or None when none came within timeout (or the worker died)."""
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], max(timeout, 0.0))
        if not ready:
            return None
        line = out.readline()
        if not line:
            return None
        reply: dict[str, Any] = json.loads(line)
        return reply

    def check(self, text: str, timeout: float) -> str | None:
        """None when the schema built within timeout; else why not. Raises TimeoutError (the
        worker must then be killed) when no verdict came in time."""
        self._send(json.dumps({"schema": text}))
        reply = self._read(timeout)
        if reply is None:
            raise TimeoutError
        return None if reply.get("ok") else str(reply.get("error"))

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class CompileWorkers:
    """A pool of up to `config.compile_workers` worker processes (thread-safe).

    tokenizer: "module:function" building the llguidance tokenizer in the worker from `args`
        (JSON values)."""

    def __init__(self, tokenizer: str, args: Sequence[Any], config: GrammarConfig) -> None:
        if config.compile_workers < 1:
            raise ValueError(f"compile_workers must be >= 1 for a pool, got {config.compile_workers!r}")
        self.config = config
        self._hello = json.dumps(
            {"tokenizer": tokenizer, "args": list(args), "config": dataclasses.asdict(config)}
        )
        self._idle: list[_Worker] = []
        self._cond = threading.Condition()
        self._started = 0  # workers alive or starting (at most config.compile_workers)
        self.killed = 0  # workers killed at the time limit (tests and logs read it)

    def _acquire(self) -> _Worker:
        """An idle worker, or a new one while fewer than the limit exist; else wait for one
        to come back (or die: its place is then taken by a new one)."""
        with self._cond:
            while not self._idle and self._started >= self.config.compile_workers:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _Worker(self._hello)
        except Exception:
            self._release(None)
            raise

    def _release(self, w: _Worker | None) -> None:
        with self._cond:
            if w is not None and w.alive:
                self._idle.append(w)
            else:
                self._started -= 1
            self._cond.notify()

    def check(self, text: str) -> None:
        """Raises GrammarError unless a worker builds the schema within the time limit."""
        worker = self._acquire()
        limit = self.config.max_compile_seconds
        t0 = time.perf_counter()
        try:
            problem = worker.check(text, limit)
        except TimeoutError:
            worker.kill()
            self.killed += 1
            log.warning("a JSON schema did not compile within %.1fs; its worker was killed", limit)
            raise GrammarError(
                f"the JSON schema took longer than {limit:g}s to compile (cancelled at the limit)"
            ) from None
        finally:
            self._release(worker if worker.alive else None)
        if problem is not None:
            raise GrammarError(problem)
        log.debug("a JSON schema passed its worker check in %.3fs", time.perf_counter() - t0)

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


def _serve(stdin: IO[str], stdout: IO[str]) -> None:
    """The worker's loop (see the module docstring)."""
    hello = json.loads(stdin.readline())
    module, _, name = str(hello["tokenizer"]).partition(":")
    tokenizer = getattr(importlib.import_module(module), name)(*hello["args"])
    config = GrammarConfig(**hello["config"])
    eos = [int(t) for t in tokenizer.eos_tokens]
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    for line in stdin:
        text = str(json.loads(line)["schema"])
        reply: dict[str, Any]
        try:
            build_matcher(tokenizer, prepare(text, config), eos, config)
            reply = {"ok": True}
        except GrammarError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # a bug or a resource error in llguidance: the schema's problem
            reply = {"error": f"the JSON schema cannot be compiled: {type(exc).__name__}: {exc}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


def main() -> None:
    # Checks never take CPU the engine wants: the idle scheduling class (run only where a CPU
    # has nothing else to run; Linux), else the lowest priority.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError, AttributeError):
            os.nice(19)
    _serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
