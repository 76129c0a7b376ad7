"""`wim setup` and `wim run` as a user runs them: the console script in a subprocess.

`--help` of every subcommand is covered by tests/cli/test_layers_cli.py.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import EXAMPLES, OWN_ENGINE_CORE, TEST_ENGINE
from tests.harness.process_tree import ended, survivors
from wim_service.cli.lifecycle import GRACE_S
from wim_service.wim.backend import EngineLimits
from wim_service.wim.options import RelevanceMode, WiMOptions
from wim_service.wim.plan import plan_document
from wim_service.wim.prompts import PromptBuilder

WIM = Path(sys.executable).with_name("wim")
REPORT = EXAMPLES / "harbor_report.txt"
QUERY = "What is the access code for the night gate?"


def segment_count(tokenizer, segment_tokens: int) -> int:
    options = WiMOptions(segment_tokens=segment_tokens)
    limits = EngineLimits(TEST_ENGINE.max_model_len, TEST_ENGINE.block_size, True)
    builder = PromptBuilder(tokenizer, options.prompts)
    return len(plan_document(builder, REPORT.read_text(), options, limits).segments)


def wim(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(WIM), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def engine_flags(model_dir: Path) -> list[str]:
    """The test engine's settings, as `wim run` flags, on the own-process engines' core."""
    return [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        str(TEST_ENGINE.max_model_len),
        "--kv-cache-gib",
        "0.5",
        "--cpu-threads-bind",
        OWN_ENGINE_CORE,
    ]


def test_setup_prints_the_model_and_punkt_folders(model_dir: Path) -> None:
    done = wim("setup")
    assert done.returncode == 0, done.stderr
    paths = dict(line.split(":", 1) for line in done.stdout.splitlines())
    assert Path(paths["default model"].strip()) == model_dir
    assert (model_dir / "config.json").is_file()
    punkt = Path(paths["punkt data"].strip())
    assert any(punkt.rglob("*")), f"{punkt} is empty"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--context", "/nonexistent/doc.txt"], "/nonexistent/doc.txt"),
        # Options are validated before any engine starts.
        (["--context", str(REPORT), "--segment-tokens", "8"], "segment_tokens"),
    ],
)
def test_run_refuses_bad_input_with_status_2(args: list[str], message: str) -> None:
    done = wim("run", "--query", QUERY, *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("wim: ") and message in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("command", ["run", "bench", "eval"])
@pytest.mark.parametrize(
    ("content", "message"), [(None, "options.json"), ('{"top_k": 5}', "top_k")]
)
def test_a_bad_options_file_is_refused_with_status_2(
    command: str, content: str | None, message: str, tmp_path: Path
) -> None:
    """A missing or invalid `--options` file: one line and status 2, before any engine."""
    path = tmp_path / "options.json"
    if content is not None:
        path.write_text(content)
    extra = ["--context", str(REPORT), "--query", QUERY] if command == "run" else []
    done = wim(command, *extra, "--options", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("wim: ") and message in done.stderr


@pytest.mark.engine
@pytest.mark.own_engines
@pytest.mark.timeout(1200)
def test_run_json_with_model_relevance_and_segment_size(model_dir: Path, tokenizer) -> None:
    """One engine start: every `wim run` flag that shapes the job, checked in its output."""
    segment_tokens = 160
    done = wim(
        "run",
        "--context",
        str(REPORT),
        "--query",
        QUERY,
        "--json",
        "--relevance",
        RelevanceMode.CLASSIFIER.value,
        "--segment-tokens",
        str(segment_tokens),
        *engine_flags(model_dir),
        timeout=1100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # --json: stdout is exactly one JSON object
    assert set(result) == {"margins", "answer", "usage", "timings"}
    assert result["answer"].strip()
    # --segment-tokens: the document was cut as the orchestrator cuts it at that size.
    segments = result["usage"]["segments"]
    assert segments == segment_count(tokenizer, segment_tokens)
    assert segments > segment_count(tokenizer, WiMOptions().segment_tokens)
    assert [m["segment"] for m in result["margins"]] == list(range(segments))
    # Segments without a sentence near the question get no margin (skip_unmatched_segments).
    written = [m for m in result["margins"] if not m["skipped"]]
    assert 0 < len(written) < segments
    assert all(m["text"] == "" for m in result["margins"] if m["skipped"])
    # --relevance classifier: every written margin was judged in a turn of its own, whose
    # prompt the job's minimal prompt tokens count (first_token and none have no such turn).
    builder = PromptBuilder(tokenizer, WiMOptions().prompts)
    usage = result["usage"]
    without_judges = (
        usage["context_tokens"]
        + len(written) * len(builder.margin_suffix(QUERY, RelevanceMode.CLASSIFIER))
        + len(builder.final_suffix(QUERY, []))
    )
    judges = sum(
        len(builder.classifier_prompt(QUERY, m["text"]))
        for m in written
        if m["text"] and not m["cut_short"]
    )
    assert judges > 0
    assert usage["minimal_prompt_tokens"] >= without_judges + judges
    assert result["timings"]["total_s"] > 0


# A command as `wim_service.cli` runs one, in a process of its own: stopping it kills its
# process tree, which in this process would include the test session's engine. It starts a
# child, prints that child's pid and waits in the way argv[1] names.
STOPPED_COMMAND = """
import asyncio, subprocess, sys, time
from wim_service.cli.lifecycle import run_command, run_subprocess

async def command(wait):
    child = subprocess.Popen(["sleep", "60"])
    try:
        # Within the `try`: the test signals as soon as it reads this line (printed before
        # it, a signal could strike between the two, with no `finally` to run yet).
        print(child.pid, flush=True)
        if wait == "blocked":
            time.sleep(60)  # as vLLM's start blocks the event loop
        else:
            await asyncio.sleep(60)
    finally:
        print("cleaned up", flush=True)
        if wait in ("hung cleanup", "slow walk"):
            time.sleep(60)

if sys.argv[1] == "slow walk":  # a walk of /proc by the stopping threads takes seconds
    import threading, psutil
    walk = psutil.Process.children
    def slow_walk(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(3)
        return walk(self, *args, **kwargs)
    psutil.Process.children = slow_walk

if sys.argv[1] == "subprocess":  # a child that ignores Ctrl-C, started by `wim serve`'s way
    code = (
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "print(0, flush=True); time.sleep(60)"
    )
    sys.exit(run_subprocess([sys.executable, "-c", code], {}))
if sys.argv[1] == "stopping subprocess":  # a child whose stop outlasts the grace, as Serve's
    code = (
        "import signal, subprocess, time; "
        "parts = [subprocess.Popen(['sleep', '60']) for _ in range(2)]; "
        "signal.signal(signal.SIGINT, lambda *_: (parts[0].kill(), parts[0].wait())); "
        "print(0, flush=True); time.sleep(60)"
    )
    sys.exit(run_subprocess([sys.executable, "-c", code], {}))
sys.exit(run_command(command(sys.argv[1])))
"""


@pytest.mark.parametrize(
    ("wait", "signum", "within_s"),
    [
        ("awaiting", signal.SIGTERM, 4),  # the task is cancelled, its `finally` runs
        ("blocked", signal.SIGINT, 4),  # interrupted in the blocking call
        ("hung cleanup", signal.SIGTERM, GRACE_S + 3),  # the watchdog kills and exits
        ("subprocess", signal.SIGINT, GRACE_S + 3),  # the watchdog kills it
        ("stopping subprocess", signal.SIGINT, GRACE_S + 3),  # the watchdog kills the rest
    ],
)
def test_a_signal_stops_the_command_and_kills_what_it_started(
    wait: str, signum: signal.Signals, within_s: float
) -> None:
    command = subprocess.Popen(
        [sys.executable, "-c", STOPPED_COMMAND, wait],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    descendants: list[psutil.Process] = []
    try:
        assert command.stdout is not None
        command.stdout.readline()  # its child runs
        descendants = psutil.Process(command.pid).children(recursive=True)
        assert descendants
        started = time.monotonic()
        command.send_signal(signum)
        out, err = command.communicate(timeout=within_s + 5)
        took = time.monotonic() - started
        assert command.returncode == 128 + signum, err
        assert took < within_s
        assert survivors(descendants, started + within_s) == []
        assert f"wim: stopped by {signum.name}" in err
        if "subprocess" not in wait:
            assert "cleaned up" in out
        # Where the threads were, only for a stop that hung: a child whose processes end is
        # still stopping at the deadline and is ended with one line; one that ignores the
        # signal hangs.
        if wait == "stopping subprocess":
            assert err.splitlines() == [f"wim: stopped by {signum.name}"]
        elif wait not in ("awaiting", "blocked"):
            assert "where it was:" in err and "most recent call first" in err
    finally:
        command.kill()
        for process in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def test_the_watchdog_kills_what_it_recorded_however_slow_a_walk_of_proc_is() -> None:
    """On a starved machine a walk of /proc took seconds: the watchdog then still kills the
    processes it recorded at `GRACE_S`, before its last walk and faulthandler's deadline
    (`GRACE_S` + 2), which used to strike first and leave the tree running."""
    command = subprocess.Popen(
        [sys.executable, "-c", STOPPED_COMMAND, "slow walk"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child: psutil.Process | None = None
    try:
        assert command.stdout is not None
        child = psutil.Process(int(command.stdout.readline()))
        started = time.monotonic()
        command.send_signal(signal.SIGTERM)
        while not ended(child) and time.monotonic() - started < GRACE_S + 10:
            time.sleep(0.05)
        took = time.monotonic() - started
        assert ended(child) and took < GRACE_S + 1.5, took
        command.communicate(timeout=10)
    finally:
        command.kill()
        if child is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_serve_says_when_the_service_is_ready(capsys) -> None:
    import http.server

    from wim_service.cli.serve import announce_ready

    polls: list[str] = []

    class Readiness(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # 503 until the second poll, as while an engine starts
            polls.append(self.path)
            self.send_response(200 if len(polls) > 1 else 503)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Readiness)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        announce_ready(url, poll_s=0.05)
    finally:
        server.shutdown()
    assert polls == ["/readyz", "/readyz"]
    assert (
        capsys.readouterr().out == f"wim_service ready at {url} (POST /wim, /v1, the page at /)\n"
    )
