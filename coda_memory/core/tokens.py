"""A conservative token estimate for prompt text, with no tokenizer dependency.

:func:`estimate_tokens` never counts fewer tokens than the byte-level BPE tokenizers of
current models (checked against ``o200k_base`` and ``cl100k_base`` in the tests),
and stays close to them on ordinary English. Text is read in pieces, as those
tokenizers pre-split it:

* a run of ASCII letters, with the one space or punctuation character before it: one
  token when the run is a word of :data:`KNOWN_WORDS` (lower case or capitalised)
  after a space or nothing, one more after punctuation; otherwise one token per byte;
* a group of up to three ASCII digits: one token (both vocabularies hold every such
  group);
* a run of ASCII punctuation, with the space before it: one token for a space and one
  character, otherwise one per character;
* any other character: one token per UTF-8 byte. No byte-level BPE gives a byte more
  than one token, so this bounds rare CJK characters, math letters and emoji.

Hosts that know their model's tokenizer can pass an exact counter instead
(``MemoryService(token_counter=...)``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

TokenCounter = Callable[[str], int]

#: Words that both tokenizers encode in ``cost`` tokens or fewer (lower case or
#: capitalised, alone or after a space) and in ``cost + 1`` after any ASCII punctuation
#: character but the apostrophe. The tests check every entry against both vocabularies.
_ONE_TOKEN = """
about above access account add after again air album all almost along also always an and
animal another answer any api are around as ask at away bank be because been before
begin below between big body book both boy but by call can car change city client close
come company context contract contracts corp could country customer cut data database
day did different do does domain door down each earth east eat end entities error even
every example eye face failed family far father few file files find first focus follow
food for form found four from get girl global go good got great group grow had hand hard
has have he head help her here high home house how id if important in inc instructions
international into invoice is it its just keep kind know known label land large last
later learn leave left let letter life light like limited line lines list little long
look made make many market may mean media men miss more most mother move much music must
my name names near need never new next night no north not now number of off often old on
once one only open or order other our out over override own page paper part past payment
permission picture plant play point preferences product products project put query quote
quotes read real records report results right river room run sales same say schema
school sea search second see server service services sessions set shop should show side
small so some something sometimes song soon south spell sql start state status still
stop store story studio study such table tables take talk team tell text than that the
their them then there these this those thought three through time timeout to too tool
tools track tree try turn two type under up us usage use user uses very walk want was
watch way we well were west what when where which while white who why will with without
words work works world would write wrong year you your
"""
_TWO_TOKENS = """
acme asks began came carry denied enough feet frequent hear him holdings idea ids isrc
ltd might mile mountain observed partners publishing quoted recorded revenue royalties
royalty said saw seem studios successfully together took went
"""
_THREE_TOKENS = """
entertainment prioritise
"""
KNOWN_WORDS: dict[str, int] = {
    **dict.fromkeys(_ONE_TOKEN.split(), 1),
    **dict.fromkeys(_TWO_TOKENS.split(), 2),
    **dict.fromkeys(_THREE_TOKENS.split(), 3),
}

#: Every form a known word is counted in (lower case and capitalised), with its cost.
_FORMS: dict[str, int] = {
    form: cost for word, cost in KNOWN_WORDS.items() for form in (word, word.capitalize())
}

_PUNCTUATION = r"!-/:-@\[-`{-~"
#: As the tokenizers pre-split: a letter run with the space or punctuation character
#: before it, a punctuation run with the space before it, a digit group, or any single
#: character.
_PIECE = re.compile(
    rf"([ {_PUNCTUATION}]?)([A-Za-z]+)|( ?[{_PUNCTUATION}]+)|([0-9]{{1,3}})|(.)", re.DOTALL
)
#: Longer texts are not worth keeping in the cache.
_CACHED_CHARS = 400


def _word_cost(lead: str, word: str) -> int:
    cost = _FORMS.get(word)
    if cost is None or lead == "'":  # "'s", "'t", "'re"… split differently
        return len(lead) + len(word)
    return cost if lead in ("", " ") else cost + 1


def _punctuation_cost(run: str) -> int:
    # A space and one punctuation character is one token in both vocabularies.
    return 1 if len(run) == 2 and run[0] == " " else len(run)


def _ascii_estimate(text: str) -> int:
    total = 0
    for lead, word, punctuation, _, _ in _PIECE.findall(text):
        if word:
            total += _word_cost(lead, word)
        elif punctuation:
            total += _punctuation_cost(punctuation)
        else:
            total += 1  # a digit group or one ASCII character
    return total


def _estimate(text: str) -> int:
    total = 0
    for match in _PIECE.finditer(text):
        lead, word, punctuation, digits, other = match.groups()
        if word:
            start, end = match.start(), match.end()
            if (start > 0 and not text[start - 1].isascii()) or (
                end < len(text) and not text[end].isascii()
            ):
                total += len(lead) + len(word)  # glued to a non-ASCII letter: bytes
            else:
                total += _word_cost(lead, word)
        elif punctuation:
            total += _punctuation_cost(punctuation)
        elif digits:
            total += 1
        else:
            total += len(other.encode("utf-8", "surrogatepass"))
    return total


@lru_cache(maxsize=8192)
def _cached_estimate(text: str) -> int:
    return _ascii_estimate(text) if text.isascii() else _estimate(text)


def estimate_tokens(text: str) -> int:
    """A token count of ``text`` that real tokenizers do not exceed (see the module)."""
    if len(text) <= _CACHED_CHARS:
        # Prompt lines repeat from one load to the next.
        return _cached_estimate(text)
    return _ascii_estimate(text) if text.isascii() else _estimate(text)
