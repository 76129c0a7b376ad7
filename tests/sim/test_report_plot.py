"""`wim sim --plot`'s figure (`sim/report.py`, `plot_p95`): read back from the figure it saved,
not from the PNG's pixels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import pytest
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from wim_service.sim.report import plot_p95

ROWS = [
    # Out of order, as a sweep's rows may come: each policy's line goes by fleet size.
    {"policy": "expected_wait", "replicas": 4, "ttft_p95_s": 0.5},
    {"policy": "round_robin", "replicas": 2, "ttft_p95_s": 3.0},
    {"policy": "expected_wait", "replicas": 2, "ttft_p95_s": 1.0},
    {"policy": "round_robin", "replicas": 4, "ttft_p95_s": 2.0},
]


class _Saved:
    """Every figure `plot_p95` saves, with the arguments of its `savefig`."""

    def __init__(self) -> None:
        self.calls: list[tuple[Figure, tuple[Any, ...], dict[str, Any]]] = []


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> _Saved:
    record = _Saved()
    savefig = Figure.savefig

    def recording(fig: Figure, *args: Any, **kwargs: Any) -> None:
        record.calls.append((fig, args, kwargs))
        savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    return record


def _plot(saved: _Saved, tmp_path: Path, floor_s: float | None) -> tuple[Figure, Axes, Path]:
    path = tmp_path / "p95.png"
    plot_p95(ROWS, path, title="hot documents", floor_s=floor_s)
    assert path.stat().st_size > 0
    [(fig, args, kwargs)] = saved.calls
    assert args == (path,) and kwargs == {"dpi": 90}
    [ax] = fig.axes
    return fig, ax, path


def test_one_line_per_policy_by_fleet_size_on_log_axes(saved: _Saved, tmp_path: Path) -> None:
    fig, ax, _ = _plot(saved, tmp_path, floor_s=None)
    assert matplotlib.get_backend().lower() == "agg"
    assert tuple(fig.get_size_inches()) == (6, 4)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["expected_wait", "round_robin"]  # in the rows' order
    assert list(lines["expected_wait"].get_xdata()) == [2, 4]
    assert list(lines["expected_wait"].get_ydata()) == [1.0, 0.5]
    assert list(lines["round_robin"].get_xdata()) == [2, 4]
    assert list(lines["round_robin"].get_ydata()) == [3.0, 2.0]
    assert all(line.get_marker() == "o" for line in lines.values())
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.xaxis.get_transform().base == 2  # fleets double
    assert ax.yaxis.get_transform().base == 10
    assert ax.get_xlabel() == "engine replicas"
    assert ax.get_ylabel() == "p95 time to first token, s"
    assert ax.get_title() == "hot documents" and ax.title.get_fontsize() == 10
    legend = ax.get_legend()
    assert [text.get_text() for text in legend.get_texts()] == ["expected_wait", "round_robin"]
    # Grid lines on the minor ticks too (log axes), faint.
    for axis in (ax.xaxis, ax.yaxis):
        for [tick] in (axis.get_major_ticks(1), axis.get_minor_ticks(1)):
            assert tick.gridline.get_visible() and tick.gridline.get_alpha() == 0.3


def test_the_floor_is_a_dashed_grey_line(saved: _Saved, tmp_path: Path) -> None:
    _, ax, _ = _plot(saved, tmp_path, floor_s=0.25)
    floor = ax.get_lines()[-1]
    assert floor.get_label() == "floor (no placement beats)"
    assert list(floor.get_ydata()) == [0.25, 0.25]
    assert floor.get_linestyle() == "--"
    assert to_rgba(floor.get_color()) == to_rgba("grey")
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["expected_wait", "round_robin", "floor (no placement beats)"]
