"""The `wim` command and the package's import structure.

Every module imports on its own (no module that only works after another one was imported;
import cycles, lazy and type-only ones included, are tests/test_layers.py's), every
subcommand's `--help` works through the console script, and the engine flags come from
`EngineConfig` itself.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest

from wim_service.engine.config import EngineConfig
from wim_service.wim.options import RelevanceMode, WiMOptions

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "wim_service"
WIM = Path(sys.executable).with_name("wim")
ENGINE_FLAGS = ["--" + name.replace("_", "-") for name in EngineConfig.cli_fields()]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}

# Imports every wim_service module named on the command line, each in a forked child of an
# interpreter that has loaded the third-party modules they import but no wim_service module:
# each import starts from an empty wim_service state, as `python -c "import wim_service.x"`
# would, without paying vLLM's import (tens of seconds on a loaded machine) once per module.
IMPORT_EACH = r"""
import importlib, json, os, sys, traceback

third_party, modules = json.loads(sys.argv[1]), sys.argv[2:]
for name in third_party:
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # then the wim_service module that needs it fails below, as it should
preloaded = sorted(m for m in sys.modules if m.split(".")[0] == "wim_service")
failures = {"<preload>": repr(preloaded)} if preloaded else {}
for name in modules:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            error = b""
        except BaseException:
            error = traceback.format_exc().encode()
        with os.fdopen(write, "wb") as out:
            out.write(error)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as result:
        error = result.read().decode()
    _, status = os.waitpid(pid, 0)
    if error or status:
        failures[name] = error or f"child exited with status {status}"
print(json.dumps(failures))
"""


def _third_party_imports() -> list[str]:
    """The other packages' modules that wim_service modules import at module level."""
    found: set[str] = set()
    for path in MODULES.values():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module)
    return sorted(m for m in found if m.split(".")[0] not in ("wim_service", "__future__"))


def test_every_module_imports_on_its_own() -> None:
    assert len(MODULES) > 30  # the walk found the package
    third_party = json.dumps(_third_party_imports())
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, third_party, *MODULES],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{name}:\n{error}" for name, error in failures.items())


def test_import_check_reports_a_module_that_needs_another_first(tmp_path: Path) -> None:
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic.b import B\n\nA = 1\n")
    (package / "b.py").write_text("from cyclic.a import A\n\nB = 1\n")
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, "[]", "cyclic", "cyclic.a", "cyclic.b"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(failures) == {"cyclic.a", "cyclic.b"}
    assert "partially initialized module" in failures["cyclic.a"]


# Pointers to design notes and research kept outside the repository: a reader cannot follow them.
OUTSIDE_DOCUMENTS = re.compile(r"\bDESIGN\b|research/|\.\./shared|§")


def test_no_reference_to_documents_outside_the_repository() -> None:
    texts = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "tests").rglob("*.py"),
        ROOT / "README.md",
    ]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in texts
        if path != Path(__file__)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE_DOCUMENTS.search(line)
    ]
    assert found == []


def _help(*command: str) -> str:
    done = subprocess.run(
        [str(WIM), *command, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("command", "engine_flags"),
    [
        ((), False),
        (("run",), True),
        (("bench",), True),
        (("eval",), True),
        (("serve",), False),
        (("setup",), False),
        (("sim",), False),
        (("calibrate",), True),
    ],
)
def test_help_of_every_subcommand(command: tuple[str, ...], engine_flags: bool) -> None:
    text = _help(*command)
    listed = [flag for flag in ENGINE_FLAGS if flag in text]
    # `wim sim` models one engine setting under the engine's own flag.
    modelled = ["--side-by-side-kv-reserve"] if command == ("sim",) else []
    assert listed == (ENGINE_FLAGS if engine_flags else modelled)
    if not command:
        assert "{run,serve,bench,eval,setup,sim,calibrate}" in text
    if engine_flags:
        assert "--no-enable-prefix-caching" in text
        # Help comes from the model's field descriptions, defaults included.
        assert "KV cache size in GiB" in " ".join(text.split())
        assert "(default: 8192)" in " ".join(text.split())


def test_bench_keeps_its_flags() -> None:
    text = _help("bench")
    for flag in (
        "--context",
        "--repeat",
        "--segment-tokens",
        "--concurrency",
        "--rounds",
        "--skip-reference",
        "--json-out",
        "--serving",
        "--store",
        "--relevance",
        "--options",
    ):
        assert flag in text


def test_options_files_fill_in_under_the_flags(tmp_path: Path) -> None:
    """`--options` of run, bench and eval: the fields a file sets win, the flags fill the
    rest, a flag given as None sets nothing, and the file is validated like an HTTP body."""
    from pydantic import ValidationError

    from wim_service.cli.run import read_options

    path = tmp_path / "options.json"
    path.write_text(json.dumps({"segment_tokens": 256, "prompts": {"no_margins": "(no notes)"}}))
    options = read_options(path, segment_tokens=1024, relevance="classifier")
    assert (options.segment_tokens, options.relevance) == (256, RelevanceMode.CLASSIFIER)
    assert options.prompts.no_margins == "(no notes)"
    assert read_options(None, segment_tokens=None) == WiMOptions()
    assert read_options(None, segment_tokens=128).segment_tokens == 128
    path.write_text(json.dumps({"top_k": 5}))
    with pytest.raises(ValidationError, match="top_k"):
        read_options(path)


def test_bench_sends_the_options_it_runs_with(tmp_path: Path) -> None:
    """`wim bench --options`: the in-process jobs and the HTTP bodies of `--serving` get the
    same options (a body carries what differs from the defaults)."""
    from wim_service.benchmarks.common import BenchSettings
    from wim_service.cli.bench import add_parser, settings_from

    path = tmp_path / "options.json"
    path.write_text(json.dumps({"margin_max_tokens": 24}))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--options", str(path), "--segment-tokens", "256"])
    settings: BenchSettings = settings_from(args)
    assert settings.options == WiMOptions(margin_max_tokens=24, segment_tokens=256)
    assert settings.wire_options() == {"margin_max_tokens": 24, "segment_tokens": 256}
    assert WiMOptions.model_validate(settings.wire_options()) == settings.options


def _parser() -> argparse.ArgumentParser:
    return EngineConfig.add_cli_args(argparse.ArgumentParser(exit_on_error=False))


def _other_value(name: str) -> tuple[list[str], object]:
    """Flags that set field `name` to a value other than its default, and that value."""
    field = EngineConfig.model_fields[name]
    flag, default = "--" + name.replace("_", "-"), field.default
    if isinstance(default, bool):
        return [flag if not default else "--no-" + flag[2:]], not default
    if get_origin(field.annotation) is Literal:
        choice = next(c for c in get_args(field.annotation) if c != default)
        return [flag, choice], choice
    if isinstance(default, int | float):
        return [flag, str(2 * default)], 2 * default  # doubling keeps every bound and rule
    if default is None and float in get_args(field.annotation):  # an optional number
        return [flag, "2.5"], 2.5
    if default is None or isinstance(default, str):
        return [flag, "value-from-cli"], "value-from-cli"
    raise AssertionError(f"no test value for {name}: {field.annotation}")


def test_every_field_but_the_seed_is_a_flag() -> None:
    assert set(EngineConfig.cli_fields()) == set(EngineConfig.model_fields) - {"seed"}


@pytest.mark.parametrize("name", EngineConfig.cli_fields())
def test_each_flag_reaches_its_field(name: str) -> None:
    argv, value = _other_value(name)
    config = EngineConfig.from_cli_args(_parser().parse_args(argv))
    fields = EngineConfig.model_fields
    changed = {n: getattr(config, n) for n in fields if getattr(config, n) != fields[n].default}
    assert changed == {name: value}


@pytest.mark.parametrize("name", EngineConfig.cli_fields())
def test_a_config_gives_the_flags_that_make_it_again(name: str) -> None:
    """A report's command line (`wim bench --json-out`) reproduces the engine it ran."""
    argv, _ = _other_value(name)
    config = EngineConfig.from_cli_args(_parser().parse_args(argv))
    assert config.cli_argv() == [" ".join(argv)]
    again = shlex.split(" ".join(config.cli_argv()))
    assert EngineConfig.from_cli_args(_parser().parse_args(again)) == config
    assert EngineConfig().cli_argv() == []


def test_defaults_and_overrides() -> None:
    args = _parser().parse_args(["--max-sessions", "3"])
    assert EngineConfig.from_cli_args(_parser().parse_args([])) == EngineConfig()
    # An override wins over the flag the user gave (the benchmark's patient admission).
    config = EngineConfig.from_cli_args(args, max_sessions=4, admission_timeout_s=3600.0)
    assert (config.max_sessions, config.admission_timeout_s) == (4, 3600.0)
    # Another subcommand's own --seed is not the engine's.
    args.seed = 7
    assert EngineConfig.from_cli_args(args).seed == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-model-len", "10"], "greater than or equal to 256"),
        (["--kv-cache-gib", "0"], "greater than 0"),
        (["--dtype", "int8"], "'bfloat16'"),
        (["--block-size", "many"], "valid integer"),
    ],
)
def test_bad_values_are_argument_errors(argv: list[str], message: str) -> None:
    with pytest.raises(argparse.ArgumentError, match=message):
        _parser().parse_args(argv)


def test_cross_field_rule_still_applies() -> None:
    args = _parser().parse_args(["--max-sessions", "100", "--max-num-seqs", "128"])
    with pytest.raises(ValueError, match="max_num_seqs must be at least 2 x max_sessions"):
        EngineConfig.from_cli_args(args)


@pytest.mark.parametrize(
    ("dtype", "flags", "expected"),
    [
        ("auto", {"avx2", "fma"}, "float32"),  # bfloat16 would be emulated
        ("auto", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ("auto", {"avx2", "amx_tile", "amx_bf16"}, "bfloat16"),
        ("bfloat16", {"avx2"}, "bfloat16"),  # an explicit choice stays
        ("float32", {"amx_bf16"}, "float32"),
    ],
)
def test_auto_dtype_follows_the_cpu(dtype: str, flags: set[str], expected: str) -> None:
    config = EngineConfig.model_validate({"dtype": dtype})
    assert config.cpu_dtype(frozenset(flags)) == expected


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    from wim_service.engine.config import cpu_flags

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\nbugs\t\t: spectre\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert EngineConfig().dtype == "auto"
