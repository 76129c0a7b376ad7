"""PDF to text for `POST /extract/pdf`, in a worker process the router can kill.

pypdf runs on whatever a client uploads: a few kilobytes can cost it minutes of CPU or
gigabytes of memory (a content stream of millions of operators, a stream that inflates to
75 MB), and a thread cannot be stopped. So each PDF is read by its own worker process
(`serving/http/pdf_worker.py`) that the router awaits without blocking its event loop and kills
past `RouterConfig.pdf_timeout_s`, when the request is cancelled, and when the router shuts
down. The worker limits its own address space (`pdf_max_memory_bytes`), refuses more pages
than `pdf_max_pages` and more text than `max_document_chars` (the service would not take it).
Every way a worker fails answers with a fixed message: no pypdf text reaches a client.

A worker parses what a client sent, so it gets none of the router's secrets: its environment
is `WORKER_ENV` alone (no API keys, Redis URL or password, store key, cloud credentials). A
router runs at most `pdf_max_workers` at once, whichever tenants send them.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys

from pydantic import BaseModel, ValidationError

from wim_service.serving.config import RouterConfig
from wim_service.serving.errors import ServiceCode, ServiceError
from wim_service.serving.http.pdf_worker import Refusal
from wim_service.wim.errors import ErrorCode

WORKER = "wim_service.serving.http.pdf_worker"
# What a worker keeps of the router's environment: what Python needs to start and import this
# package, and the locale.
WORKER_ENV = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR")


class ExtractedText(BaseModel):
    text: str
    pages: int


class _Answer(BaseModel):
    """What the worker writes: the text, or why not."""

    text: str = ""
    pages: int = 0
    refused: Refusal | None = None


class PdfExtractor:
    """One router's PDF workers, each bounded as its `RouterConfig` says."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._workers: set[asyncio.subprocess.Process] = set()
        self._running = 0  # extractions under way, workers starting included
        self._closed = False

    async def extract(self, data: bytes) -> ExtractedText:
        """The text of the PDF `data`; `ServiceError` if it cannot be read within the bounds,
        or now (`pdf_max_workers` are reading)."""
        self._check_open()
        if self._running >= self.config.pdf_max_workers:
            raise ServiceError(
                ErrorCode.OVERLOADED,
                f"this router is reading {self._running} PDFs, the most it reads at once; "
                "retry later",
                self.config.retry_after_s,
            )
        self._running += 1
        try:
            return await self._extract(data)
        finally:
            self._running -= 1

    async def _extract(self, data: bytes) -> ExtractedText:
        config = self.config
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            WORKER,
            str(config.pdf_max_pages),
            str(config.max_document_chars),
            str(config.pdf_max_memory_bytes),
            # A backstop for a worker whose router died before it could kill it.
            str(math.ceil(config.pdf_timeout_s) + 1),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,  # pypdf's warnings quote the document
            env={name: os.environ[name] for name in WORKER_ENV if name in os.environ},
        )
        self._workers.add(worker)
        try:
            async with asyncio.timeout(config.pdf_timeout_s):
                out, _ = await worker.communicate(data)
        except TimeoutError as exc:
            raise ServiceError(
                ServiceCode.TOO_COMPLEX,
                f"reading this PDF took longer than {config.pdf_timeout_s:g} s, "
                "the most this service gives it",
            ) from exc
        finally:
            # On time-out and on cancellation (the client went away) alike: never left running.
            self._workers.discard(worker)
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
        self._check_open()  # killed by `close`, not by the document
        return self._answer(out)

    def _answer(self, out: bytes) -> ExtractedText:
        try:
            answer = _Answer.model_validate_json(out)
        except ValidationError:  # it died without an answer (e.g. out of memory on the way)
            answer = _Answer(refused=Refusal.UNREADABLE)
        config = self.config
        match answer.refused:
            case None:
                return ExtractedText(text=answer.text, pages=answer.pages)
            case Refusal.PAGES:
                raise ServiceError(
                    ErrorCode.TOO_LONG,
                    f"the PDF has {answer.pages} pages; this service reads at most "
                    f"{config.pdf_max_pages}",
                )
            case Refusal.CHARS:
                raise ServiceError(
                    ErrorCode.TOO_LONG,
                    f"the PDF's text is longer than {config.max_document_chars} characters, "
                    "the most this service takes",
                )
            case Refusal.MEMORY:
                raise ServiceError(
                    ServiceCode.TOO_COMPLEX,
                    f"reading this PDF needs more than {config.pdf_max_memory_bytes // 2**20} "
                    "MiB, the most this service gives it",
                )
            case Refusal.UNREADABLE:
                raise ServiceError(ErrorCode.INVALID_INPUT, "not a readable PDF")

    def _check_open(self) -> None:
        if self._closed:
            raise ServiceError(
                ErrorCode.UNAVAILABLE,
                "this router is shutting down; send the PDF again",
                self.config.retry_after_s,
            )

    def close(self) -> None:
        """Kill every running worker (the router is shutting down); start no new one."""
        self._closed = True
        for worker in self._workers:
            if worker.returncode is None:
                worker.kill()
