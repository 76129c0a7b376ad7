"""How many decode steps the simulator gives a WiM query's margins (`sim/jobs.py`,
`MarginsPrefill`): the margin prompts' prefill writes each margin's first token, so margins of
one token decode nothing and the query's prefill follows at once, and each further token is
one step of the margins' batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.profile import PROFILE
from tests.sim.test_sim import doc_row, document_trace, run


@pytest.mark.parametrize("margin_tokens", [1, 2, 3])
def test_margins_take_one_decode_step_per_token_after_their_first(
    tmp_path: Path, margin_tokens: int
) -> None:
    trace = document_trace([doc_row(0, "a", wim=True, tokens=3000)], tmp_path)
    settings = {"segment_tokens": 1024, "margin_tokens": margin_tokens}
    (outcome,) = run(trace, "expected_wait", 1, **settings).outcomes
    p, margins = PROFILE, 3  # ceil(3000 / 1024)
    read = p.prefill.seconds(3000)
    prompts = p.prefill.seconds(margins * p.margin_prompt_tokens, cached=3000)
    context = margins * (3000 + p.margin_prompt_tokens + 1)
    decode = sum(
        p.decode.step_seconds(margins, context + margins * j) for j in range(margin_tokens - 1)
    )
    query = p.prefill.seconds(40 + margins * margin_tokens + p.query_extra_tokens, cached=3000)
    assert outcome.first_token_s == pytest.approx(read + prompts + decode + query)
    assert outcome.end_s > outcome.first_token_s  # and the answer is decoded after it
