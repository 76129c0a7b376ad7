"""Scorers: exact match for question answering, F1 for aggregation (as the paper reports).

Answers from chat models wrap the value in a sentence ("The code for the north gate is 4417."),
so exact match here is RULER's string match: the normalized gold value must occur as whole words
in the normalized answer. A near miss (4471 for 4417, Belmor for Belmora) scores 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

from wim_service.eval.tasks import Task, TaskKind
from wim_service.wim.grounding import Claim, vocabulary

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans(string.punctuation, " " * len(string.punctuation))


def normalize(text: str) -> list[str]:
    """SQuAD normalization: lower case, no punctuation, no articles; returns the words."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def exact_match(answer: str, gold: str) -> float:
    """1.0 if the gold value occurs as a run of whole words in the answer, else 0.0."""
    words, target = normalize(answer), normalize(gold)
    n = len(target)
    hit = n > 0 and any(words[i : i + n] == target for i in range(len(words) - n + 1))
    return float(hit)


def token_f1(predicted: list[str], gold: list[str]) -> float:
    """Harmonic mean of precision and recall over word multisets (SQuAD's F1)."""
    common = sum((Counter(predicted) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Score:
    exact: float
    f1: float

    def primary(self, kind: TaskKind) -> float:
        """The number a task kind is judged by: F1 for aggregation, exact match otherwise."""
        return self.f1 if kind is TaskKind.AGGREGATION else self.exact


def score(task: Task, answer: str) -> Score:
    """Score one answer. For aggregation only the list's own words count as predictions, once
    each: "The most common words are: belto, ..." is then judged on the words it names."""
    if task.kind in (TaskKind.AGGREGATION, TaskKind.BABI):
        # bAbI-style: the answer must name the right room and no other ("kitchen or garden"
        # is wrong); exact match requires exactly the gold set in both kinds.
        named = list(dict.fromkeys(w for w in normalize(answer) if w in task.vocabulary))
        gold = [w.lower() for w in task.gold]
        return Score(exact=float(set(named) == set(gold)), f1=token_f1(named, gold))
    return Score(
        exact=max(exact_match(answer, g) for g in task.gold),
        f1=max(token_f1(normalize(answer), normalize(g)) for g in task.gold),
    )


def hallucinated_values(answer: str, task: Task) -> list[str]:
    """Numbers and names in `answer` that neither the document nor the query contains.

    Names are capitalised words that do not open a sentence (as the grounding check reads
    them); a value the model invented is the clearest sign of an answer made up.
    """
    claim = Claim.parse(answer)
    known = vocabulary(task.document) | vocabulary(task.query)
    return sorted(v for v in claim.exact_values - known if v.isalnum())
