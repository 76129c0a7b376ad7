"""`wim bench --kv-restore` (`wim_service/benchmarks/restore.py`) over a stand-in engine whose
reads and restores take set times: what each round times, in which order, the ratio and its
interval. The real run is docs/kv-store.md's; its engine is the calibration's
(tests/placement/test_restore_cost.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from wim_service.benchmarks import restore as bench
from wim_service.benchmarks.common import DEFAULT_DOCUMENT, BenchSettings
from wim_service.engine.config import EngineConfig
from wim_service.wim.backend import KVRestore, StoredDocument
from wim_service.wim.options import WiMOptions


class StandIn:
    """An engine whose reads take 6 s (6.2 s saving) and restores 0.3 s, round by round a
    little slower, as drifting load does."""

    def __init__(self, window: int) -> None:
        self.limits = SimpleNamespace(max_model_len=window, block_size=32)
        self.tokenizer = SimpleNamespace(
            encode_user_text=lambda text: SimpleNamespace(ids=list(range(1000)))
        )
        self.calls: list[str] = []
        self.deleted: list[StoredDocument] = []

    def slower(self) -> float:
        return 1 + 0.01 * len(self.calls)

    async def read(self, _: Any, ids: list[int], stored: StoredDocument | None) -> float:
        self.calls.append("save" if stored else "re-read")
        return (6.2 if stored else 6.0) * self.slower()

    async def restore(self, _: Any, ids: list[int], stored: StoredDocument) -> KVRestore:
        self.calls.append("restore")
        return KVRestore(len(ids) - 32, 32, 0.3 * self.slower(), None, holds_document=True)

    async def delete_stored(self, doc: StoredDocument) -> bool:
        self.deleted.append(doc)
        return True


def settings(rounds: int) -> BenchSettings:
    return BenchSettings(
        context=DEFAULT_DOCUMENT,
        repeat=1,
        options=WiMOptions(),
        options_file=None,
        concurrency=1,
        rounds=rounds,
        skip_reference=True,
        json_out=None,
        engine=EngineConfig(),
    )


@pytest.mark.parametrize(("window", "tokens"), [(8192, 4096), (2048, 2047)])
async def test_each_round_times_a_re_read_a_saving_read_and_a_restore(
    monkeypatch: pytest.MonkeyPatch, window: int, tokens: int
) -> None:
    engine = StandIn(window)
    monkeypatch.setattr(bench, "read_document", engine.read)
    monkeypatch.setattr(bench, "restore_document", engine.restore)
    result = await bench.bench_restore(engine, settings(4))  # type: ignore[arg-type]
    # The 4,096-token document, or what the window holds; the sample text repeated.
    assert result["document_tokens"] == tokens
    # The re-read runs first in even rounds, last in odd ones.
    first_two = ["re-read", "save", "restore", "save", "restore", "re-read"]
    assert engine.calls[:6] == first_two and engine.calls[6:] == first_two
    rounds = result["rounds"]
    assert [r["ratio"] for r in rounds] == pytest.approx(
        [r["restore_s"] / r["re_read_s"] for r in rounds]
    )
    assert all(r["computed_tokens"] == 32 for r in rounds)
    interval = result["ratio_interval"]
    assert interval["rounds"] == 4 and interval["low"] < result["ratio"] < interval["high"]
    assert 0.04 < result["ratio"] < 0.06
    # Every round's document is deleted from the store after it.
    assert len({doc.document for doc in engine.deleted}) == 4


def test_the_command_has_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from wim_service.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "--kv-restore" in capsys.readouterr().out


def test_a_short_document_is_repeated_to_the_benchmarks_length() -> None:
    ids = bench.document_ids(StandIn(8192), settings(1))  # type: ignore[arg-type]
    assert ids == list(range(1000)) * 4 + list(range(96))
