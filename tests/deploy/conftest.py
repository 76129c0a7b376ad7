"""The chart tests' fixtures: each value set of the chart, rendered once per module."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chart import VALUE_SETS, render


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def value_set(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def manifests(value_set: str) -> list[dict[str, Any]]:
    return render(VALUE_SETS[value_set])
