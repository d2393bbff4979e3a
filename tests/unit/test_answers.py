"""The last answers a service keeps for loads that outlive their timeout."""

from __future__ import annotations

from coda_memory.core.answers import LastAnswers
from coda_memory.core.model import LoadedMemory
from tests.builders import fact


def answer(count: int, name: str = "t") -> LoadedMemory:
    facts = [fact(f"tool_affinity:{name}{n}") for n in range(count)]
    return LoadedMemory(facts=facts, prompt_section=name, tool_affinities={name: 0.5})


def test_answers_are_kept_up_to_the_capacity_least_recently_used_out() -> None:
    answers = LastAnswers(capacity=5)
    answers.put("a", answer(2, "a"))
    answers.put("b", answer(2, "b"))
    assert answers.get("a") is not None  # a is now the most recently used
    answers.put("c", answer(2, "c"))
    assert answers.get("b") is None
    assert answers.get("a") == answer(2, "a") and answers.get("c") == answer(2, "c")
    assert len(answers) == 4
    answers.put("a", answer(1, "a"))  # replaced, not added
    assert len(answers) == 3


def test_empty_and_oversized_answers_are_not_kept_and_discard_forgets() -> None:
    answers = LastAnswers(capacity=3)
    answers.put("a", answer(0))
    answers.put("b", answer(4))
    assert answers.get("a") is None and answers.get("b") is None and len(answers) == 0
    answers.put("c", answer(2))
    answers.discard("c")
    assert answers.get("c") is None and len(answers) == 0


def test_a_kept_answer_is_given_as_a_copy() -> None:
    answers = LastAnswers()
    answers.put("a", answer(2))
    given = answers.get("a")
    assert given is not None
    given.facts.clear()
    given.tool_affinities.clear()
    assert answers.get("a") == answer(2)
