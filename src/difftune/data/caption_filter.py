"""Caption filters (`caption_filter_list` on a text_embeds entry, as in SimpleTuner): remove or replace text in
every caption a dataset reads, before its text embedding is cached.

Each entry is one of:
- `s/FIND/REPLACE/FLAGS`, a sed-style substitution: FIND is a regular expression, REPLACE may use `\\1` or
  `\\g<name>` (`\\g<0>`: the whole match), `\\/` is a slash in either; FLAGS: `g` every match (without it, the
  first match only, as sed and SimpleTuner's documentation say), `i` ignore case;
- anything else: removed wherever it occurs as written, then wherever it matches as a regular expression
  (Python `re`). That is what SimpleTuner does with an entry, so a plain phrase, a phrase with brackets
  (`(blurry)`) and a regex (`^there is`, `this .* has a`) each give the caption SimpleTuner gives.

Entries run in order, each on the result of the one before. A caption that any entry changed is then tidied:
runs of spaces and tabs become one space and each line is stripped (blank lines are kept to one). A caption
no entry changed is left byte for byte as it was, so its cached text embedding still matches.

Pure (no torch): config/caption_filter_keys.py checks a list with `CaptionFilter.parse` before any model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# s/FIND/REPLACE/FLAGS: "\/" (any escaped character) stays inside a part
_SUBSTITUTION = re.compile(r"s/((?:[^\\/]|\\.)*)/((?:[^\\/]|\\.)*)/([A-Za-z]*)", re.DOTALL)
_NO_CLOSING = re.compile(r"s/((?:[^\\/]|\\.)*)/((?:[^\\/]|\\.)*)", re.DOTALL)
_SPACES = re.compile(r"[^\S\n]+")  # whitespace other than line breaks
_BLANK_LINES = re.compile(r"\n{3,}")


class FilterError(ValueError):
    """An entry that cannot be used; `label` says where it is ("line 3" of a file, "entry 3" of a list)."""

    def __init__(self, label: str, entry: str, reason: str):
        super().__init__(f"{label} {entry!r}: {reason}")
        self.label, self.entry, self.reason = label, entry, reason


@dataclass(frozen=True)
class Rule:
    entry: str  # as written, for messages
    pattern: re.Pattern[str]
    replacement: str | None = None  # a substitution's; None: remove (the entry as written, then its matches)
    count: int = 0  # 0: every match; 1: the first (s/// without g)

    def apply(self, text: str) -> str:
        if self.replacement is None:
            return self.pattern.sub("", text.replace(self.entry, ""))
        return self.pattern.sub(self.replacement, text, count=self.count)


@dataclass(frozen=True)
class CaptionFilter:
    rules: tuple[Rule, ...]

    @classmethod
    def parse(cls, entries: list[tuple[str, str]]) -> CaptionFilter:
        """[(label, entry)] -> the filter; FilterError names the first entry that cannot be used. Empty entries
        (a blank line of a file) remove nothing and are passed over."""
        return cls(tuple(_rule(label, entry) for label, entry in entries if entry))

    def apply(self, caption: str) -> str:
        """The filtered caption (tidied when an entry changed it)."""
        text = caption
        for rule in self.rules:
            text = rule.apply(text)
        return caption if text == caption else tidy(text)


def tidy(text: str) -> str:
    """Runs of spaces and tabs as one space, each line stripped, at most one blank line in a row."""
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def _rule(label: str, entry: str) -> Rule:
    if not entry.strip():
        raise FilterError(label, entry, "an entry of only spaces would remove every such space of every caption; "
                                        "delete it (spaces a filter leaves behind are tidied anyway)")
    if entry.startswith("s/"):
        return _substitution(label, entry)
    return Rule(entry, _compile(label, entry, entry, 0, "remove it as written: escape the regular-expression "
                                                        "characters in it with a backslash, e.g. \\( \\) \\[ \\? \\*"))


def _substitution(label: str, entry: str) -> Rule:
    match = _SUBSTITUTION.fullmatch(entry)
    if match is None:
        if _NO_CLOSING.fullmatch(entry):
            raise FilterError(label, entry, "a substitution ends with '/' (s/find/replace/: the first match; "
                                            "s/find/replace/g: every match, which is what SimpleTuner's code does "
                                            "with this form); add the closing '/' and g if you want every match")
        raise FilterError(label, entry, "entries starting with 's/' are sed-style substitutions, written "
                                        "s/find/replace/ (write \\/ for a '/' inside find or replace); fix it, or "
                                        "write s\\/ to remove the text 's/...' instead")
    find, replace, flags = match.groups()
    if bad := sorted(set(flags) - set("gi")):
        raise FilterError(label, entry, f"unknown flag(s) {''.join(bad)!r} after the last '/'; use g (every "
                                        "match, not only the first), i (ignore case), both or none")
    if not find:
        raise FilterError(label, entry, "the find part is empty; write s/find/replace/")
    pattern = _compile(label, entry, find, re.IGNORECASE if "i" in flags else 0, "fix the find part")
    replacement = replace.replace("\\/", "/")
    try:
        pattern.sub(replacement, "")  # the replacement template is checked here, without a match
    except (re.error, IndexError) as e:
        raise FilterError(label, entry, f"the replacement is not valid ({e}); use \\1 or \\g<name> for groups "
                                        "of find, \\g<0> for the whole match, and \\\\ for a backslash") from e
    return Rule(entry, pattern, replacement, 0 if "g" in flags else 1)


def _compile(label: str, entry: str, source: str, flags: int, fix: str) -> re.Pattern[str]:
    try:
        return re.compile(source, flags)
    except re.error as e:
        raise FilterError(label, entry, f"not a valid regular expression ({e}); {fix}") from e
