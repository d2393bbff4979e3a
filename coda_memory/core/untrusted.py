# ruff: noqa: RUF001, RUF002 - confusable letters are the point of this module
"""Untrusted text shown as data inside a system prompt.

Entity names, entity ids and every other value that tool results or users control may
reach the memory section of a system prompt. :func:`data_text` makes such a value one
line of plain data that cannot steer the model, in this order:

1. **Normalised.** NFKC folds compatibility forms: fullwidth ``ＳＹＳＴＥＭ``, circled
   and math-alphanumeric letters (``𝓢𝔂𝓼𝓽𝓮𝓶``) and ligatures become plain letters.
2. **Invisible characters removed.** Unicode categories Cc, Cf (zero-width and bidi
   controls, the tags block), Co, Cn, Cs, Zl and Zp, every Default_Ignorable_Code_Point
   (variation selectors such as U+FE0F, Hangul fillers U+115F, U+1160, U+3164, U+FFA0,
   the combining grapheme joiner, ...), the braille blank U+2800, combining marks with
   no base, and combining marks past the second on one base. Whitespace runs become one
   space; the result is one line.
3. **Confusables folded before checks.** The checks below run on a copy in which
   Cyrillic, Greek, Armenian and Lisu letters that look like Latin ones, the Latin small
   capitals, and colons that look like ``:`` (:data:`CONFUSABLES`, from Unicode's
   confusables.txt), are Latin letters and ``:``, so ``ЅYЅТЕМ:``, ``[ɪɴsᴛ]`` and
   ``SYSTEM꞉`` are caught like ``SYSTEM:`` and ``[INST]``.
4. **Structure neutralised.** URLs (any ``scheme://``, ``//host``, ``www.`` hosts,
   ``javascript:``-like schemes, ``host.tld/path``) become ``(link removed)``; tags
   such as ``<img …>`` or ``<|im_start|>`` and every other ``<`` or ``>`` become a space,
   and so do look-alikes of ``<`` and ``>`` (:data:`ANGLE_OPENERS`) where they draw a tag
   or a template token (``‹|im_start|›``, ``˂/tool_result˃``; around one word, only the
   angles: ``˂system˃`` is ``system``), not in prose (``‹Das ist gut›``, ``⟨a, b⟩``);
   ``[INST]``-like markers go, also drawn with look-alikes of their brackets
   (:data:`BRACKET_OPENERS`, the opening and closing punctuation of Unicode but quotes
   and angles, and quasi-quotation corners: ``«SYS»``, ``【INST】``, ``⟦TOOL_CALLS⟧``,
   ``「SYS」``, ``⌜SYS⌝``, ``⦃SYS⦄``; not in prose, ``【Notice】``, ``«Bonjour»``,
   ``「システム」``, ``⌈x⌉``; around a word of prose, only the brackets, the word kept as
   written: ``«User»`` is ``User``, ``«Usér»`` is ``Usér``), and a space splits ``](``,
   ``][``, ``]:`` and ``![``, so no markdown link or image can form; a role word
   followed by a colon (``SYSTEM:``,
   ``assistant:``, ``### Instruction:``), or a ReAct step's (``Question:``, ``Thought:``,
   ``Action:``, ``Action Input:``, ``Observation:``, ``Final Answer:``), loses the colon. URLs, turn
   markers, link syntax and role words that accents hide (a combining mark inside the
   word, ``S̶ystem:``, ``system̶.system/``, ``w̶ww.x``, or a precomposed letter,
   ``Sýstem:``, ``[ÍNST]``, ``ẃww.x``) are caught too: they are matched again on a copy
   in which every letter is its base letter and the marks are gone, and such a match
   loses its accents with the rest of its replacement (a URL goes whole: ``ev́il.com/x``).
   Runs of ``#`` and HTML entities (``&lt;``) become a space, also when accents hide
   them (``#́#́#``). Every removal leaves a space, so removing one pattern cannot join its
   neighbours into another; a combining mark left without its letter by a removal goes
   too.
5. **Capped** at ``max_chars`` characters, ending in "…" when cut. The "…" completes
   no structure of step 4 (a ``www.``, ``//`` or ``http:`` with only a "…" after it is
   no link), so cleaning a cut text again changes nothing either.

Printable ASCII without ``<>[]#&:``, ``www``, ``//`` or a ``.tld/`` skips all of this but
the whitespace collapsing: that is the common case, and it stays fast.
"""

from __future__ import annotations

import bisect
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache

ELLIPSIS = "…"
LINK_REMOVED = "(link removed)"

#: Cyrillic, Greek, Armenian and a few Latin-extension letters that look like a Latin
#: letter (the Latin small capitals among them), and characters that look like a colon,
#: from Unicode's confusables.txt (one character to one character, so positions line up).
CONFUSABLES: dict[int, str] = {
    ord(k): v
    for k, v in {
        # Cyrillic capitals and small letters
        "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P",
        "С": "C", "Т": "T", "У": "Y", "Х": "X", "Ѕ": "S", "І": "I", "Ј": "J", "Ԁ": "D",
        "Ԛ": "Q", "Ԝ": "W", "Ү": "Y", "Һ": "h", "Ӏ": "I", "а": "a", "е": "e", "о": "o",
        "р": "p", "с": "c", "у": "y", "х": "x", "ѕ": "s", "і": "i", "ј": "j", "ԁ": "d",
        "ԛ": "q", "ԝ": "w", "һ": "h", "ӏ": "l", "ү": "y", "ɡ": "g", "Ь": "b", "г": "r",
        "ѡ": "w", "Ѵ": "V", "ѵ": "v", "ҽ": "e", "Ԍ": "G",
        # Greek capitals and small letters
        "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M",
        "Ν": "N", "Ο": "O", "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X", "Ϲ": "C", "ϒ": "Y",
        "α": "a", "ο": "o", "ρ": "p", "ν": "v", "ι": "i", "υ": "u", "ϲ": "c", "ϳ": "j",
        "κ": "k", "τ": "t", "ϵ": "e", "γ": "y", "σ": "o", "ϱ": "p", "Ϳ": "J", "Ϝ": "F",
        "Ϻ": "M",
        # Latin look-alikes and Armenian
        "ı": "i", "ɑ": "a", "ʏ": "y", "ȷ": "j", "օ": "o", "ս": "u", "ց": "g", "հ": "h",
        "Ս": "U", "Տ": "S", "Օ": "O", "ա": "w", "գ": "q", "զ": "q", "ո": "n", "ռ": "n",
        "ք": "f",
        # Latin small capitals, which NFKC leaves alone
        "ᴀ": "a", "ʙ": "b", "ᴄ": "c", "ᴅ": "d", "ᴇ": "e", "ꜰ": "f", "ɢ": "g", "ʜ": "h",
        "ɪ": "i", "ᴊ": "j", "ᴋ": "k", "ʟ": "l", "ᴍ": "m", "ɴ": "n", "ᴏ": "o", "ᴘ": "p",
        "ꞯ": "q", "ʀ": "r", "ꜱ": "s", "ᴛ": "t", "ᴜ": "u", "ᴠ": "v", "ᴡ": "w", "ᴢ": "z",
        # Lisu capitals
        "ꓐ": "B", "ꓑ": "P", "ꓒ": "d", "ꓓ": "D", "ꓔ": "T", "ꓖ": "G", "ꓗ": "K", "ꓙ": "J",
        "ꓚ": "C", "ꓜ": "Z", "ꓝ": "F", "ꓟ": "M", "ꓠ": "N", "ꓡ": "L", "ꓢ": "S", "ꓣ": "R",
        "ꓦ": "V", "ꓧ": "H", "ꓪ": "W", "ꓫ": "X", "ꓬ": "Y", "ꓮ": "A", "ꓰ": "E", "ꓲ": "I",
        "ꓳ": "O", "ꓴ": "U",
        # Colons that NFKC leaves alone: modifier letters, ratio, Armenian, Hebrew,
        # Syriac, runic, Lisu, two-dot punctuation, Mongolian (its colon, and the full
        # stops confusables.txt gives as colons), Ethiopic (its colon and wordspace),
        # the Devanagari and Gujarati visarga, the Z notation type colon, tricolon; and
        # other colons drawn as dots one above another: Bamum, the skewed Syriac ones,
        # the triple colon operator, cuneiform, SignWriting, Manichaean and Old Uyghur
        "꞉": ":", "ː": ":", "˸": ":", "∶": ":", "։": ":", "׃": ":", "܃": ":", "܄": ":",
        "᛬": ":", "ꓽ": ":", "⁚": ":", "᠄": ":", "፥": ":", "ः": ":", "ઃ": ":", "⦂": ":",
        "⁝": ":", "᠃": ":", "᠉": ":", "፡": ":", "꛴": ":", "܆": ":", "܇": ":", "܈": ":",
        "܉": ":", "⫶": ":", "𒑱": ":", "𒑲": ":", "𝪊": ":", "𐫵": ":", "𐾈": ":",
    }.items()
}  # fmt: skip

#: Default_Ignorable_Code_Point ranges (Unicode 15) plus the braille blank U+2800.
_IGNORABLE_RANGES: tuple[tuple[int, int], ...] = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x2800, 0x2800),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cn", "Cs", "Zl", "Zp"})
_MARK_CATEGORIES = frozenset({"Mn", "Me"})
#: Combining marks kept on one base: enough for Vietnamese and most Indic clusters,
#: too few for "Zalgo" stacks.
MAX_LATIN_MARKS_PER_BASE = 2


_IGNORABLE_BMP = frozenset(
    chr(code) for low, high in _IGNORABLE_RANGES if high < 0x10000 for code in range(low, high + 1)
)


def is_invisible(char: str) -> bool:
    """True for a character that renders as nothing (or as a blank that is not a space)."""
    code = ord(char)
    if code < 0x80:
        return not (0x20 <= code < 0x7F)
    if char in _IGNORABLE_BMP or unicodedata.category(char) in _INVISIBLE_CATEGORIES:
        return True
    return code >= 0x10000 and any(low <= code <= high for low, high in _IGNORABLE_RANGES)


# -- structure patterns, matched on the confusable-folded text -----------------------------

#: The branches of :data:`_URL`, in order (:func:`_url_pattern` leaves out those that
#: cannot match in a text).
_URL_BRANCHES: tuple[str, ...] = (
    # any scheme://, matched from the start of its run of non-delimiters only (where
    # every match of it starts anyway): tried at every position, the run before "://"
    # was read again from each, quadratic in a long run without "://" ("x:x:x:…")
    r"(?<![^\s\"'<>()\[\]{}])[^\s\"'<>()\[\]{}]*://[^\s\"'<>()\[\]{}]*",
    # (a host, or what follows "www." or "http:", is more than a "…": the one that ends
    # a cut text, "xx www.…" or "//…", would make it a link, and cleaning it again,
    # "xx (lin…", would change it)
    r"(?<![\w/])//\u2026*[^\s\"'<>()\[\]{}/\u2026][^\s\"'<>()\[\]{}]*",  # //host
    r"\bwww\d{0,3}\.\u2026*[^\s\"'<>()\[\]{}\u2026][^\s\"'<>()\[\]{}]*",  # www.host
    r"\b(?:javascript|vbscript|data|file|mailto|blob|ftp):[^\s\"'<>()\[\]{}]*",
    # http: and ws: without "//", which a browser reads as the same link
    r"\b(?:https?|wss?):\u2026*[^\s\"'<>()\[\]{}\u2026][^\s\"'<>()\[\]{}]*",
    # host.tld/path: labels of any script or with "_", a punycode top level, a dot of
    # another script (what browsers take for one); not after a word or "@"
    r"(?<![\w.\-@\u3002\uff0e\uff61])(?:[\w\-]+[.\u3002\uff0e\uff61])+"
    r"(?:[^\W\d_]{2,24}|xn--[a-z0-9\-]{1,59})(?::\d{1,5})?/[^\s\"'<>()\[\]{}]*",
    r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?/[^\s\"'<>()\[\]{}]*",  # IPv4/path
)
_URL = re.compile("|".join(_URL_BRANCHES), re.IGNORECASE)
#: What every match of a branch of :data:`_URL` holds, each looked for from a literal
#: "." or ":" (which a search finds fast) rather than tried at every position: "www"
#: and up to three digits before a ".", and a named scheme before a ":" (the scheme's
#: last letter tested first, so that a run of colons, "x:x:x:…", costs one test each).
_WWW_DOT = re.compile(
    r"\.(?:(?<=www\.)|(?<=www\d\.)|(?<=www\d\d\.)|(?<=www\d\d\d\.))", re.IGNORECASE
)
#: The schemes the fourth and fifth branches name.
_SCHEMES = (
    "javascript", "vbscript", "data", "file", "mailto", "blob", "ftp", "https", "http", "wss",
    "ws",
)  # fmt: skip
_SCHEME_COLON = re.compile(
    f":(?<=[{''.join(sorted({scheme[-1] for scheme in _SCHEMES}))}]:)"
    f"(?:{'|'.join(f'(?<={scheme}:)' for scheme in _SCHEMES)})",
    re.IGNORECASE,
)


def _url_branches_in(folded: str) -> int:
    """Which branches of :data:`_URL` may match in ``folded``: bit ``i`` for branch ``i``."""
    mask = 0
    if "/" in folded:
        if "." in folded or "\u3002" in folded or "\uff0e" in folded or "\uff61" in folded:
            mask |= 0b1100000  # host.tld/path, 1.2.3.4/path
        if "//" in folded:
            mask |= 0b0000010
            if "://" in folded:
                mask |= 0b0000001
    if "." in folded and _WWW_DOT.search(folded):
        mask |= 0b0000100
    if ":" in folded and _SCHEME_COLON.search(folded):
        mask |= 0b0011000
    return mask


_URL_BY_BRANCHES: dict[int, re.Pattern[str]] = {0b1111111: _URL}


def _url_pattern(folded: str) -> re.Pattern[str] | None:
    """:data:`_URL` without the branches that cannot match in ``folded`` (None when
    none can): the same matches, at a fraction of the cost. Tried at every position of
    an id of 200 characters, "x:x:x:…", the seven branches took 60 µs, more than half
    of a fact line's cleaning, though none could match."""
    mask = _url_branches_in(folded)
    if not mask:
        return None
    pattern = _URL_BY_BRANCHES.get(mask)
    if pattern is None:
        branches = (branch for i, branch in enumerate(_URL_BRANCHES) if mask >> i & 1)
        pattern = _URL_BY_BRANCHES[mask] = re.compile("|".join(branches), re.IGNORECASE)
    return pattern


#: (Each pattern below starts with a literal in every branch, which a search skips to.)
_TAG = re.compile(r"<(?:[^<>]{0,64}>)?|>")

#: Look-alikes of ``<`` and ``>`` that NFKC leaves alone: those of Unicode's
#: confusables.txt (the single angle quotation marks, modifier arrowheads, Canadian
#: syllabics PA and PO, the runic kauna, the heavy angle ornaments, Greek instrumental
#: notation, a Miao letter) and the other single angle brackets (CJK, mathematical,
#: ornaments; NFKC makes U+2329 and U+232A the CJK ones, and the fullwidth and small
#: forms ``<`` and ``>``).
ANGLE_OPENERS = "\u2039\u02c2\u1438\u16b2\u276e\U0001d236\u3008\u27e8\u276c\u2770\u29fc"
ANGLE_CLOSERS = "\u203a\u02c3\u1433\u276f\U00016f3f\U0001d237\u3009\u27e9\u276d\u2771\u29fd"
_ANGLE_LOOKALIKE = re.compile(f"[{ANGLE_OPENERS}{ANGLE_CLOSERS}]")


#: The words of roles and template tokens whose tag, drawn with look-alike angles, goes
#: with attributes however spaced (an equation in prose is kept, ``<a b = c>``; one that
#: opens with one of these is not, ``<system role = admin>``).
_TAG_ROLE = (
    r"(?i:system|developer|assistant|user|human|ai|model|bot|tools?|function|ipython|sys"
    r"|inst|instructions?|prompt|message|think|im_start|im_end|start_of_turn|end_of_turn"
    r"|tool_calls?|tool_results?|start_header_id|end_header_id|eot_id|begin_of_text)"
)
#: One attribute of such a tag, "=" spaced or not, its value a word or quoted: ``role =
#: admin``, ``id="x"`` (not an equation, ``y = ax + b``, nor a sentence, ``= Kunde``).
_TAG_ATTRIBUTE = r"""[A-Za-z_:][\w:.\-]*\s?=\s?(?:\w[\w.\-]*|"[^"]{0,40}"|'[^']{0,40}')"""


def _lookalike_tag_pattern() -> re.Pattern[str]:
    """Tags and template tokens written with look-alikes of ``<`` and ``>`` (one of the
    two ends may be ASCII): ``‹|im_start|›``, ``˂system˃``, ``‹/tool_result›``,
    ``‹‹SYS››``, ``⟨img src=x⟩``, and the halves ``‹|`` and ``|›``. Only such shapes:
    these characters are quotation marks and brackets of ordinary prose too (``‹Das
    ist gut›``, ``⟨a, b⟩``, ``〈3〉``), left alone. A pair around one word is group
    ``name``, its runs of angles ``open`` and ``close``."""
    opener, closer = f"[{ANGLE_OPENERS}]", f"[{ANGLE_CLOSERS}]"
    any_opener, any_closer = f"[<{ANGLE_OPENERS}]", f"[>{ANGLE_CLOSERS}]"
    inner = f"[^<>{ANGLE_OPENERS}{ANGLE_CLOSERS}]{{0,62}}?"
    name = r"[A-Za-z][A-Za-z0-9_:\-]{0,63}"
    close = f"{any_closer}{{1,3}}"
    body = (
        rf"\|{inner}{close}"  # a template token: <|im_start|>, <|eot_id|>
        rf"|{inner}\|\s?{close}"  # <...|>
        rf"|[/!?]\s?{name}{inner}{close}"  # a closing tag, <!DOCTYPE ...>, <?xml ...>
        rf"|{name}\s?/\s?{close}"  # <br/>
        # a role's or a template's word with attributes, "=" spaced or not: <system role
        # = admin> (not a title in angle quotes, <User Guide>)
        rf"|{_TAG_ROLE}(?:\s{_TAG_ATTRIBUTE}){{1,8}}\s?{close}"
        # attributes, "=" between a name and a value or before a quoted one: <img src=x>,
        # <system role = "x">; not an equation in prose, <a b = c>, <x y = 0>
        rf"|{name}\s[A-Za-z_:][\w:.\-]*(?:=(?!\s)|\s?=\s?[\"']){inner}{close}"
        rf"|(?P<name>{name})\s?(?P<close>{close})"  # one word: <system>, <<SYS>>
    )
    pair = f"(?P<open>{any_opener}{{1,3}})\\s?(?:{body})"
    # One end a look-alike at least (a pair of ASCII ends is _TAG's).
    return re.compile(
        f"(?={opener}|<{{1,3}}[^<>]{{0,64}}?{closer})(?:{pair})|{opener}\\s?\\||\\|\\s?{closer}"
    )


_LOOKALIKE_TAG = _lookalike_tag_pattern()


#: The words of ``[INST]``-like markers, between their brackets (their first letter
#: looked at first: one test where a bracket opens no marker).
_MARKER_WORDS = (
    r"\s*/?\s*(?=[abchimnprstu])(?:inst|sys|system|user|assistant|human|ai|bot"
    # Mistral's control tokens beside [INST]: the system prompt, tools, tool calls with
    # their arguments and ids, tool results, and the reasoning block
    r"|system[\s_]*prompt|tool[\s_]*calls?|available[\s_]*tools|tool[\s_]*results?"
    r"|tool[\s_]*content|args|call[\s_]*id|think"
    # and its others: images, fill-in-the-middle, audio, and the numbered fillers
    r"|img(?:[\s_]*(?:break|end))?|prefix|suffix|middle|audio|begin[\s_]*audio"
    r"|transcribe|(?:next|repeat)[\s_]*audio[\s_]*text|control[\s_]*\d{1,4})\s*"
)
_BRACKET_MARKER = re.compile(rf"\[{_MARKER_WORDS}\]", re.IGNORECASE)

#: Look-alikes of ``[`` and ``]`` (and of ``<<`` and ``>>``) that NFKC leaves alone,
#: openers and closers: every character past ASCII of category Ps or Pi (an opener) or
#: Pe or Pf (a closer) that NFKC keeps as it is, but quotation marks (``„User“``,
#: ``〝AI〞`` are quotes of prose) and look-alikes of ``<`` and ``>`` (:data:`ANGLE_OPENERS`,
#: whose single angles around one word lose only the angles); and, which that rule does
#: not find, the guillemets, which open or close (German quotes turn them round:
#: ``»SYS«``), the ornate parentheses, whose categories are the reverse of their names
#: (Arabic text runs right to left), both ways, and the corner brackets of
#: quasi-quotation (``⌜SYS⌝``, ``⌞SYS⌟``), which are symbols (So). So: the CJK double
#: angle (``《SYS》``), lenticular, tortoise shell, corner and white square brackets, the
#: mathematical ones (``⟦TOOL_CALLS⟧``, ``⟪SYS⟫``, ``⟮INST⟯``, ``⟅SYS⟆``), the white and
#: double parentheses and curly brackets (``⦅SYS⦆``, ``⦃SYS⦄``, ``⸨SYS⸩``), the Z
#: notation, ornament, ceiling, floor, half, sideways, wiggly and editorial brackets
#: (``⸢INST⸣``, ``⌈SYS⌉``, ``⸂SYS⸃``) and the Tibetan and Ogham ones. (NFKC
#: makes the vertical, fullwidth, halfwidth and small forms one of these or an ASCII
#: bracket.) Written out, not read from Unicode at import (6 ms of every start):
#: tests/unit/test_prompt_safety.py derives them by that rule from the running Python's
#: Unicode (14 and 15.1 give these) and fails when a version adds one.
BRACKET_OPENERS = (
    "\u00ab\u00bb\ufd3e\ufd3f\u231c\u231e\u0f3a\u0f3c\u169b\u2045\u2308\u230a\u2768\u276a"
    "\u2772\u2774\u27c5\u27e6\u27ea\u27ec\u27ee\u2983\u2985\u2987\u2989\u298b\u298d\u298f"
    "\u2991\u2993\u2995\u2997\u29d8\u29da\u2e02\u2e04\u2e09\u2e0c\u2e1c\u2e20\u2e22\u2e24"
    "\u2e26\u2e28\u2e55\u2e57\u2e59\u2e5b\u300a\u300c\u300e\u3010\u3014\u3016\u3018\u301a"
)
BRACKET_CLOSERS = (
    "\u00ab\u00bb\ufd3e\ufd3f\u231d\u231f\u0f3b\u0f3d\u169c\u2046\u2309\u230b\u2769\u276b"
    "\u2773\u2775\u27c6\u27e7\u27eb\u27ed\u27ef\u2984\u2986\u2988\u298a\u298c\u298e\u2990"
    "\u2992\u2994\u2996\u2998\u29d9\u29db\u2e03\u2e05\u2e0a\u2e0d\u2e1d\u2e21\u2e23\u2e25"
    "\u2e27\u2e29\u2e56\u2e58\u2e5a\u2e5c\u300b\u300d\u300f\u3011\u3015\u3017\u3019\u301b"
)
_BRACKET_LOOKALIKE = re.compile(f"[{BRACKET_OPENERS}{BRACKET_CLOSERS}]")
#: An ``[INST]``-like marker drawn with look-alikes of its brackets (one end may be
#: ASCII; a pair of ASCII ends is :data:`_BRACKET_MARKER`'s): ``«SYS»``, ``【INST】``,
#: ``⟦TOOL_CALLS⟧``, doubled too (``««SYS»»``: a run of one bracket at each end). Only
#: around the markers' words: in prose the same brackets are quotation marks, headings
#: and maths (``«Bonjour»``, ``【Notice】``, ``⟦x⟧``), left alone. Around a word of prose
#: too (``«User»``, ``【System】``, ``«AI»``) they are quotes or a heading: only the brackets
#: go there (see :func:`_lookalike_bracket_removed`).
_LOOKALIKE_BRACKET_MARKER = re.compile(
    rf"(?P<opener>[\[{BRACKET_OPENERS}])(?P=opener){{0,2}}(?P<inner>{_MARKER_WORDS})"
    rf"(?P<closer>[\]{BRACKET_CLOSERS}])(?P=closer){{0,2}}",
    re.IGNORECASE,
)
#: The markers' words that no prose holds (a closing one, ``INST``, ``SYS``, a token with
#: "_" or a digit, ``TOOL_CALLS``, ``CONTROL_8``): the marker goes whole.
_MARKER_ONLY = re.compile(r"/.*|inst|sys|.*[_0-9].*", re.IGNORECASE | re.DOTALL)


#: What a replacement function returns for a match whose group ``inner`` stays as it was
#: written, and only the rest goes (see :func:`_edits`). (No replacement holds a NUL.)
_KEEP_INNER = "\x00"


def _lookalike_bracket_removed(match: re.Match[str]) -> str:
    """What stands for a marker of :data:`_LOOKALIKE_BRACKET_MARKER`: its word as it was
    written (:data:`_KEEP_INNER`), only the brackets gone, where prose may quote it or
    head a section with it (``«User»``, ``»Assistant«``, ``【System】``, ``«AI»``,
    ``「User」`` are ``User``, ``Assistant``, ``System``, ``AI``, ``User``; ``«Usér»`` is
    ``Usér``: no bracket is left to make a token), or nothing for a word of
    :data:`_MARKER_ONLY` (``«SYS»``, ``⟦TOOL_CALLS⟧``, ``«/SYS»``)."""
    word = " ".join(match.group("inner").split())
    return " " if _MARKER_ONLY.fullmatch(word) else _KEEP_INNER


def _latin_letters() -> str:
    """The cased letters of the Latin blocks past ASCII (``é``, ``Ñ``, ``ß``, ``ŋ``,
    ``ɛ``, ``ẞ``), as ranges of a character class. A role word right after one is part
    of a word (``Réaction:``, ``Çuser:``); right after a letter of another script it is
    not (``注意SYSTEM:``: Chinese and Japanese put no space before a Latin word), nor
    after a modifier letter that looks like a quote or an accent (``ʼSYSTEM:``)."""
    blocks = (
        (0x00C0, 0x02AF),  # Latin-1 Supplement, Extended-A and -B, IPA Extensions
        (0x1D00, 0x1DBF),  # Phonetic Extensions and their Supplement
        (0x1E00, 0x1EFF),  # Latin Extended Additional
        (0x2C60, 0x2C7F),  # Latin Extended-C
        (0xA720, 0xA7FF),  # Latin Extended-D
        (0xAB30, 0xAB6F),  # Latin Extended-E
    )
    ranges: list[list[int]] = []
    for low, high in blocks:
        for code in range(low, high + 1):
            if unicodedata.category(chr(code)) not in {"Lu", "Ll", "Lt"}:
                continue
            if ranges and ranges[-1][1] == code - 1:
                ranges[-1][1] = code
            else:
                ranges.append([code, code])
    return "".join(f"\\u{low:04x}-\\u{high:04x}" for low, high in ranges)


#: What a role word cannot follow: a letter of a Latin word, accented or not, a digit
#: or "_", also with one or two combining marks after it (``Re\u0336action:``).
_IN_WORD = f"[A-Za-z0-9_{_latin_letters()}]"
_LATIN_MARKS = "[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]"
#: A role word or a ReAct step and its run of colons (group 1 the word).
_ROLE_WORD = (
    r"(system|developer|assistant|user|human|ai|model|"
    r"bot|instructions?|response|prompt|tool|function|ipython|"
    r"(?:question|thought|observation|action(?:[\s_]?input)?|action[\s_]?\d{1,3}[\s_]?input)"
    r"(?:[\s_]?\d{1,3}(?P<step>))?|"
    r"final[\s_]?answer)(?:\s*:)++(?(step)(?!\d))"
)
_ROLE = re.compile(
    # (also right after an escaped line break, "\nSYSTEM:", as JSON-escaped text has it;
    # every colon of a run, "SYSTEM::" or "SYSTEM: :", or one would stay behind)
    # (or after one escaped as JSON, C or in a URL: "\u000a", "\x0a", "%0a")
    # (a role word's first letter is looked at first: one test at a position where none
    # starts, instead of eight lookbehinds and twenty words)
    # (and the steps of a ReAct loop, which its parsers look for anywhere in a text,
    # numbered or not: "Thought:", "Action 2:", "Action Input:", "Observation:",
    # "Final Answer:", and "Question:", which opens each task of LangChain's ReAct
    # prompt, so that a model reads what follows as a new task; a numbered one not
    # before a digit, "Action 2:search" but not "Action 3:16" or "Observation 1:30 pm",
    # a verse, a time or a ratio: group "step" is set when a number ends the word, and
    # the run of colons, taken whole, must not be followed by a digit then)
    r"(?=[abdfhimopqrstu])"
    r"(?:(?<=\\[nrt])|(?<=\\u000[ad])|(?<=\\u202[89])|(?<=\\x0[ad])|(?<=%0[ad])"
    f"|(?<!{_IN_WORD})(?<!{_IN_WORD}{_LATIN_MARKS})(?<!{_IN_WORD}{_LATIN_MARKS}{{2}}))"
    + _ROLE_WORD,
    re.IGNORECASE,
)
#: What a marker of :data:`_LOOKALIKE_BRACKET_MARKER` that accents hide holds: one of
#: its opening brackets, then within its word a character past ASCII that is neither a
#: CJK one nor a guillemet (an accented letter or a mark: ``«ÍNST»``, ``【S\u0336YS】``).
#: (Japanese headings in ``【】`` are not read again on base letters for it.)
_MAYBE_HIDDEN_BRACKET_MARKER = re.compile(
    rf"[{BRACKET_OPENERS}][\s/]{{0,3}}[A-Za-z_\s]{{0,24}}"
    r"[\u0080-\u00aa\u00ac-\u00ba\u00bc-\u1fff\u20d0-\u20ff\ufe20-\ufe2f]"
)


#: A role word or a step (:data:`_ROLE`'s) right after an ASCII letter of the folded
#: text, with up to two marks between: a word's end for :data:`_ROLE`, but the letter
#: may be a look-alike folded from another script (a Cyrillic capital A before ``user:``),
#: which is no part of a Latin word (see :func:`_roles_after_other_scripts`).
_ROLE_AFTER_LETTER = re.compile(
    # (the first letter looked at first, as in _ROLE)
    "(?=[abdfhimopqrstu])"
    f"(?:(?<=[A-Za-z])|(?<=[A-Za-z]{_LATIN_MARKS})|(?<=[A-Za-z]{_LATIN_MARKS}{{2}}))" + _ROLE_WORD,
    re.IGNORECASE,
)
_IN_WORD_CHAR = re.compile(_IN_WORD)
#: Every character that :data:`CONFUSABLES` folds to an ASCII letter.
_FOLDED_LETTERS = re.compile(
    "[" + "".join(re.escape(chr(k)) for k, v in CONFUSABLES.items() if v.isalpha()) + "]"
)


def _roles_after_other_scripts(pair: _Pair) -> _Pair:
    """``pair`` with the colon of each role word or step gone that follows a letter
    folded from another script (``Аuser:``, ``αuser:``, its letter Cyrillic or Greek):
    :data:`_ROLE` reads the folded text, where that letter is a Latin one, and took the
    word for the end of a Latin word, whereas after a letter of another script that has
    no Latin look-alike (``Жuser:``) the colon went. A word whose first letter is of
    that script too is the end of its word (Greek ``και:`` is no ``ai:``). Accents on
    the word hide none (``Аúser:``: matched again as :func:`_sub_on_bases` does)."""
    text, folded = pair
    if text == folded or ":" not in folded or not _FOLDED_LETTERS.search(text):
        return pair

    def edits(scanned: str, at: Callable[[int], int]) -> list[tuple[int, int, str]]:
        # ``at``: where a position of ``scanned`` is in the text.
        found: list[tuple[int, int, str]] = []
        for match in _ROLE_AFTER_LETTER.finditer(scanned):
            start = at(match.start())
            before = start - 1
            while before > 0 and _is_mark(text[before]):
                before -= 1
            if not _IN_WORD_CHAR.match(text[before]) and _IN_WORD_CHAR.match(text[start]):
                found.append((start, at(match.end() - 1) + 1, f"{match.group(1)} "))
        return found

    pair = _splice(pair, edits(folded, lambda i: i))
    text, folded = pair
    bare = _bare(folded)
    if bare == folded or not _ROLE_AFTER_LETTER.search(bare):
        return pair
    return _splice(pair, edits(bare, _in_folded(folded)))


#: What makes brackets a markdown link, image or reference: ``](``, ``][``, ``]:``, ``![``.
_LINK_SYNTAX = re.compile(r"\](?=[(\[:])|!\[")
#: Any of the three markers that accents may hide (see :func:`_sub_on_bases`).
_ANY_MARKER = re.compile(
    "|".join(
        f"(?:{p.pattern})"
        for p in (_BRACKET_MARKER, _LOOKALIKE_BRACKET_MARKER, _LINK_SYNTAX, _ROLE)
    ),
    re.IGNORECASE,
)
_HASHES_OR_ENTITY = re.compile(r"##+|&#?[a-z0-9]{1,10};", re.IGNORECASE)
#: Printable ASCII that may hold any of the structures above (``.tld/`` for the
#: ``host.tld/path`` links; with a port, the colon already is).
_SUSPICIOUS_ASCII = re.compile(
    r"[<>\[\]#&:]|www|//|\.[a-z]{2,24}/|\.xn--|\.\d{1,3}/", re.IGNORECASE
)

_Pair = tuple[str, str]


def _sub(pattern: re.Pattern[str], repl: Callable[[re.Match[str]], str], pair: _Pair) -> _Pair:
    """Replace ``pattern``'s matches in the folded text, in both texts alike."""
    return _splice(pair, [e for m in pattern.finditer(pair[1]) for e in _edits(m, repl, _same)])


def _same(position: int) -> int:
    return position


def _edits(
    match: re.Match[str], repl: Callable[[re.Match[str]], str], at: Callable[[int], int]
) -> list[tuple[int, int, str]]:
    """The edits of one match (``at``: where a position of the text it was found in is in
    the folded text): its span replaced by ``repl``'s answer, or, when that is
    :data:`_KEEP_INNER`, each side of its group ``inner`` a space, the group kept as it
    was written (its marks too: it ends where the next character starts)."""
    replacement = repl(match)
    start, end = at(match.start()), at(match.end() - 1) + 1
    if replacement != _KEEP_INNER:
        return [(start, end, replacement)]
    return [(start, at(match.start("inner")), " "), (at(match.end("inner")), end, " ")]


def _sub_on_bases(
    pattern: re.Pattern[str] | Callable[[str], re.Pattern[str] | None],
    repl: Callable[[re.Match[str]], str],
    pair: _Pair,
) -> _Pair:
    """:func:`_sub` for the matches that accents hide: a combining mark inside a word
    (``S\u0336ystem:``, ``system\u0336.system/``) or a precomposed letter (``Sýstem:``,
    ``[ÍNST]``). ``pattern`` (or the one it gives for that copy, None for none) runs on a
    copy of the folded text in which every letter is its base letter and the marks are
    gone, and each match replaces its whole span of both texts, marks included. A text
    without accents, or without a match, is returned as it is."""
    folded = pair[1]
    if folded.isascii():
        return pair
    bare = _bare(folded)
    if bare == folded:
        return pair
    if not isinstance(pattern, re.Pattern):
        found = pattern(bare)
        if found is None:
            return pair
        pattern = found
    if not pattern.search(bare):
        return pair
    at = _in_folded(folded)
    return _splice(pair, [e for m in pattern.finditer(bare) for e in _edits(m, repl, at)])


def _splice(pair: _Pair, edits: list[tuple[int, int, str]]) -> _Pair:
    """Both texts with each ``(start, end, replacement)`` of ``edits`` (in order, not
    overlapping) made. The replacement is ASCII, so both texts keep the same length at
    every position."""
    if not edits:
        return pair
    text, folded = pair
    text_parts: list[str] = []
    folded_parts: list[str] = []
    position = 0
    for start, end, replacement in edits:
        text_parts += (text[position:start], replacement)
        folded_parts += (folded[position:start], replacement)
        position = end
    text_parts.append(text[position:])
    folded_parts.append(folded[position:])
    return "".join(text_parts), "".join(folded_parts)


def _is_mark(char: str) -> bool:
    return char >= "\u0300" and unicodedata.category(char) in _MARK_CATEGORIES


class _BaseLetterTable(dict[int, str]):
    """A ``str.translate`` table, filled as characters are met: a combining mark to NUL
    (which no cleaned text holds: :func:`_bare` removes them after), any other
    character to its base letter (``ý``: ``y``; itself if it has none), confusables
    folded. One character to one, so the positions line up with the folded text's."""

    #: Characters remembered at most (every code point would be about 100 MB).
    LIMIT = 16_384

    def __missing__(self, code: int) -> str:
        char = chr(code)
        if _is_mark(char):
            base = "\x00"
        elif code < 0xC0:
            base = char
        else:
            base = unicodedata.normalize("NFD", char)[0].translate(CONFUSABLES)
        if len(self) < self.LIMIT:
            self[code] = base
        return base


_BASE_LETTERS = _BaseLetterTable()
_MARK_PLACE = re.compile("\x00")


def _bare(folded: str) -> str:
    """``folded`` with every letter its base letter and the marks gone."""
    return _bases(folded)[1]


def _in_folded(folded: str) -> Callable[[int], int]:
    """Where each position of :func:`_bare`'s copy of ``folded`` is in ``folded``: the
    ``k``-th mark, at ``p`` in ``folded``, is before position ``p - k`` of the copy.
    (With a few marks, much cheaper than the position of every character.)"""
    marks = [m.start() - k for k, m in enumerate(_MARK_PLACE.finditer(_bases(folded)[0]))]
    return lambda i: i + bisect.bisect_right(marks, i)


@lru_cache(maxsize=4)
def _bases(folded: str) -> tuple[str, str]:
    """``folded`` translated by :data:`_BASE_LETTERS` (the marks NUL), and that without
    the marks. Remembered: one pass of :func:`_neutralise` mostly reads the text that
    the pass before it read."""
    based = folded.translate(_BASE_LETTERS)
    return based, based.replace("\x00", "") if "\x00" in based else based


#: The letters that NFD makes a "w" with accents (a look-alike is folded before).
_PRECOMPOSED_W = "\u0174\u0175\u1e80\u1e81\u1e82\u1e83\u1e84\u1e85\u1e86\u1e87\u1e88\u1e89\u1e98"
#: What a "www." host that accents hide holds in the few characters before its "."
#: (three letters and three digits, two marks on each): a precomposed "w", or a "w" or
#: a digit before a character that is not ASCII (a mark). (It starts with a set of
#: characters, which a search skips to.)
_MAYBE_HIDDEN_WWW = re.compile(
    rf"[wW\d{_PRECOMPOSED_W}](?:(?<=[{_PRECOMPOSED_W}])|[^\x00-\x7f])[^\s.]{{0,17}}\."
)


def _may_hide_link(folded: str) -> bool:
    """Whether accents may hide a link in ``folded`` (see :func:`_neutralise`): it has a
    character that is not ASCII, and a "/" or a ":", or a "www." with accents
    (:data:`_MAYBE_HIDDEN_WWW`): every link holds one of them, and no base letter or
    removed mark makes a "/", ":" or "." (the look-alikes of ":" are folded before)."""
    if folded.isascii():
        return False
    return (
        "/" in folded
        or ":" in folded
        or ("." in folded and _MAYBE_HIDDEN_WWW.search(folded) is not None)
    )


#: A character that may be a combining mark, at the start or after a space.
_MAYBE_ORPHAN = re.compile(r"(?:^| )[^\x00-\u02ff]")


def _without_orphan_marks(text: str) -> str:
    """``text`` without the combining marks that follow a space, or start it: a removal
    or replacement can leave a mark without the letter it was on."""
    if text.isascii():  # (no mark is ASCII)
        return text
    if not any(_is_mark(match.group()[-1]) for match in _MAYBE_ORPHAN.finditer(text)):
        return text
    kept: list[str] = []
    base = " "
    for char in text:
        if _is_mark(char):
            if base == " ":
                continue
        else:
            base = char
        kept.append(char)
    return "".join(kept)


def _without_lookalike_tags(pair: _Pair) -> _Pair:
    """``pair`` with each match of :data:`_LOOKALIKE_TAG` a space, also where accents
    hide it (``‹s\u0336ystem›``, ``‹sýstem›``: matched again as :func:`_sub_on_bases`
    does). A pair of single angles around one word keeps the word as it was written,
    only the angles become spaces (Swiss quotation marks: ``‹Bonjour›``)."""

    def edits(text: str, at: Callable[[int], int]) -> list[tuple[int, int, str]]:
        # ``at``: where a position of ``text`` is in the folded text.
        found: list[tuple[int, int, str]] = []
        for match in _LOOKALIKE_TAG.finditer(text):
            start, end = at(match.start()), at(match.end() - 1) + 1
            name = match.group("name")
            if name is None or len(match.group("open")) > 1 or len(match.group("close")) > 1:
                found.append((start, end, " "))
            else:  # (the word ends where the next character starts: its marks kept)
                found += [(start, at(match.start("name")), " "), (at(match.end("name")), end, " ")]
        return found

    pair = _splice(pair, edits(pair[1], lambda i: i))
    folded = pair[1]
    if folded.isascii() or not _ANGLE_LOOKALIKE.search(folded):
        return pair
    bare = _bare(folded)
    if bare == folded or not _LOOKALIKE_TAG.search(bare):
        return pair
    return _splice(pair, edits(bare, _in_folded(folded)))


def _link_removed(_: re.Match[str]) -> str:
    return f" {LINK_REMOVED} "


def _neutralise(text: str) -> str:
    """``text`` with every structure of step 4 of the module policy replaced."""
    pair = (text, text.translate(CONFUSABLES))
    if _may_hide_link(pair[1]):
        # Links that accents hide ("system\u0336.system/", "w\u0336ww.x", "/\u0336/x"),
        # first, so that each goes whole ("h\u0336ttps://x", not only its "//x").
        pair = _sub_on_bases(_url_pattern, _link_removed, pair)
    url = _url_pattern(pair[1])
    if url is not None:
        pair = _sub(url, _link_removed, pair)
    if not pair[1].isascii() and _ANGLE_LOOKALIKE.search(pair[1]):
        pair = _without_lookalike_tags(pair)
    pair = _sub(_TAG, lambda _: " ", pair)
    markers = (
        (_BRACKET_MARKER, lambda _: " "),
        # (after it, which takes a pair of ASCII brackets)
        (_LOOKALIKE_BRACKET_MARKER, _lookalike_bracket_removed),
        (_LINK_SYNTAX, lambda match: f"{match.group()[0]} {match.group()[1:]}"),
        (_ROLE, lambda match: f"{match.group(1)} "),
    )
    for pattern, repl in markers:
        pair = _sub(pattern, repl, pair)
    pair = _roles_after_other_scripts(pair)
    folded = pair[1]
    if (
        not folded.isascii()
        # every marker holds one of these
        and (
            "[" in folded
            or "]" in folded
            or ":" in folded
            or _MAYBE_HIDDEN_BRACKET_MARKER.search(folded) is not None
        )
        and _ANY_MARKER.search(_bare(folded))
    ):
        # Rare: a marker that accents hid (one search tells; the passes find which).
        for pattern, repl in markers:
            pair = _sub_on_bases(pattern, repl, pair)
    pair = _sub(_HASHES_OR_ENTITY, lambda _: " ", pair)
    if "#" in pair[1] or "&" in pair[1]:
        # A run of "#" or an entity that accents hide: "#\u0301#\u0301#", "&\u00e1mp;".
        pair = _sub_on_bases(_HASHES_OR_ENTITY, lambda _: " ", pair)
    return pair[0]


def cap(text: str, max_chars: int) -> str:
    """``text`` capped at ``max_chars`` characters, ending in "…" when cut."""
    if len(text) <= max_chars:
        return text
    if max_chars <= 0:
        return ""
    return _cut(text, max_chars)


def _cut(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars - 1`` characters and "…", without a colon after a
    digit just before the "…": a numbered ReAct step keeps its colon only before a digit
    (``Action 2:80``), which the cut takes away, so cleaning the cut text again removed
    it (``Action 2:…`` became ``Action 2 …``)."""
    head = text[: max_chars - 1].rstrip()
    if head.endswith(":") and head[-2:-1].isdigit():
        head = head[:-1]
    return head + ELLIPSIS


def read_window(max_chars: int) -> int:
    """How much of a text capped at ``max_chars`` is read: what lies past it is cut as
    if past the cap, so that a huge text that is mostly removed characters (controls,
    zero-width or bidi characters) costs what a long one does. (Read to its end, 10
    million of them held the event loop for seconds.)"""
    return 4 * max_chars + 64


def windowed(value: str, max_chars: int) -> tuple[str, bool]:
    """``value`` within its :func:`read_window`, and whether it was cut to fit."""
    limit = read_window(max_chars)
    return (value[:limit], True) if len(value) > limit else (value, False)


def capped(text: str, max_chars: int, cut: bool) -> str:
    """``text`` capped at ``max_chars`` characters, ending in "…" when cut, and also
    when ``cut`` says its input was (read only so far, see :func:`read_window`)."""
    if not cut or len(text) > max_chars:
        return cap(text, max_chars)
    return _cut(text, max_chars) if max_chars > 0 else ""


def _visible_line(text: str, max_chars: int) -> tuple[str, int | None]:
    """NFKC, then one line without invisible characters or stacked marks; reading stops
    once ``max_chars`` is certain to be exceeded. Also the least ``max_chars`` that gives
    the same line (None when reading stopped: a greater one reads further)."""
    # "…" stays itself (NFKC would make it "..."), so cleaning twice changes nothing.
    text = ELLIPSIS.join(unicodedata.normalize("NFKC", part) for part in text.split(ELLIPSIS))
    kept: list[str] = []
    pending_space = False
    marks = MAX_LATIN_MARKS_PER_BASE
    for char in text:
        if " " < char < "\x7f":  # printable ASCII but the space: always kept
            marks = 0
            if pending_space:
                kept.append(" ")
                pending_space = False
            kept.append(char)
            if len(kept) > max_chars + 1:
                break
            continue
        if char.isspace():
            pending_space = bool(kept)
            marks = MAX_LATIN_MARKS_PER_BASE
            continue
        if is_invisible(char):
            continue
        if _is_mark(char):
            if marks >= MAX_LATIN_MARKS_PER_BASE or pending_space:
                continue  # no base, or one mark too many
            marks += 1
        else:
            marks = 0
        if pending_space:
            kept.append(" ")
            pending_space = False
        kept.append(char)
        if len(kept) > max_chars + 1:
            break
    # (Reading stops exactly when more than max_chars + 1 characters are kept.)
    read_all = len(kept) <= max_chars + 1
    line = "".join(kept)
    if not unicodedata.is_normalized("NFKC", line):  # a removed character parted a letter
        line = ELLIPSIS.join(unicodedata.normalize("NFKC", part) for part in line.split(ELLIPSIS))
    return line, len(kept) - 1 if read_all else None


#: Longer values are not worth keeping in the cache.
_CACHED_CHARS = 400


def data_text(value: str, max_chars: int) -> str:
    """``value`` as one line of plain data for a system prompt (see the module policy).

    The result has at most ``max_chars`` characters, no line break, no invisible
    character, URL, markdown link or image, tag, turn marker or role marker; applying
    the function to its own result changes nothing.
    """
    if len(value) <= _CACHED_CHARS:
        # Names, ids and fact lines repeat from one observation or load to the next.
        return _cached_data_text(value, max_chars)
    return _data_text(value, max_chars)


@lru_cache(maxsize=16_384)
def _cached_data_text(value: str, max_chars: int) -> str:
    return _data_text(value, max_chars)


def _data_text(value: str, max_chars: int) -> str:
    line, cut, _ = _data_line(value, max_chars)
    return capped(line, max_chars, cut)


def _data_line(value: str, max_chars: int) -> tuple[str, bool, float]:
    """``value`` as one line of data, not yet capped at ``max_chars``; whether its
    :func:`read_window` cut it; and the least window that reads as much of it (math.inf
    when cut or when reading stopped early): every cap whose window is at least that
    gives the same line."""
    # Work on a bounded prefix: a huge value costs no more than a long one (what lies
    # past it is cut as if past the cap).
    value, cut = windowed(value, max_chars)
    need: float = math.inf if cut else len(value)
    if value.isascii() and value.isprintable():
        text = " ".join(value.split())
        if not _SUSPICIOUS_ASCII.search(value):
            return text, cut, need
    else:
        text, kept = _visible_line(value, read_window(max_chars))
        need = math.inf if kept is None else max(need, kept)
    for _ in range(3):  # one pass suffices; the loop only guards that claim
        neutral = _without_orphan_marks(" ".join(_neutralise(text).split()))
        if neutral == text:
            break
        text = neutral
    return text, cut, need


def data_texts(value: str, caps: Iterable[int]) -> Iterator[str]:
    """:func:`data_text` of ``value`` at each of ``caps`` in turn, made by cleaning
    ``value`` once for as long as the caps' windows read the same of it (any value but a
    very long one: each window reads it whole), then capping the line at each cap. (A
    fact line tried at three caps was cleaned three times.)"""
    line = ""
    need = math.inf
    for max_chars in caps:
        if need <= read_window(max_chars):
            yield cap(line, max_chars)
            continue
        line, cut, need = _data_line(value, max_chars)
        yield capped(line, max_chars, cut)
