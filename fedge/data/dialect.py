"""The built-in corpora: the stdlib corpus as the zoo learnt it, and a style of it that it did not.

The zoo's base model is pre-trained on the stdlib corpus, so clients holding that corpus
(`data-source = ""`) have little left to teach it: on the demo zoo a population of 500 phones
moved its participants' held-out perplexity by under 1% in 4 rounds, too little to tell what
privacy costs. ``corpus:indent2`` is the same programs indented by two spaces per level
instead of PEP 8's four, the house style of many code bases: a shift the base model has not
learnt (every indented line starts with a token it rarely saw: the demo zoo's held-out
perplexity is 92.8 on it against 69.3 on the stdlib, 32 windows of 64 tokens) and one a
small adapter learns fast, because the same rule holds on every line of every client (a
rank-4 adapter on q and v, B alone trained, recovered 8% in 60 centralised steps, measured
here). Other shifts tried here were learnt far more slowly: seven frequent words renamed
(``self`` -> ``me``, ...) 1-3% in 60-240 steps, since the confusion they cause spreads to
the tokens after them; comments stripped: none. It is built offline and deterministically
from the text every machine has, with the corpus's own train/held-out split (paths are
unchanged), so held-out perplexity still measures generalisation to files no client
trained on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType

PEP8_INDENT, INDENT2 = "    ", "  "
_LEADING = re.compile(r"^((?:    )+)", re.MULTILINE)  # a line's leading run of 4-space levels


def two_space_indent(text: str) -> str:
    """``text`` with each line's leading 4-space indentation levels made 2 spaces each.

    Spaces after the last whole level (continuation-line alignment) are kept as they are;
    string contents are re-indented like code, as one consistent rule.
    """
    return _LEADING.sub(lambda m: INDENT2 * (len(m.group(1)) // len(PEP8_INDENT)), text)


def _unchanged(text: str) -> str:
    return text


# `data-source = "corpus:<name>"`: each built-in corpus is the stdlib with one text transform
BUILTIN_CORPORA: Mapping[str, Callable[[str], str]] = MappingProxyType(
    {"stdlib": _unchanged, "indent2": two_space_indent}
)
