"""An incremental JSON checker: one JSON object, a character at a time.

A tool call's arguments are streamed while the model writes them; every fragment
sent must keep what the client has assembled a prefix of valid JSON. `JsonObject`
consumes text only while it remains such a prefix, stops at the character that
would break it (`error`) or right after the object's closing brace (`done`), and
records where each top-level member's key and value lie in the text it consumed,
so a caller can stream one member's value (the arguments) as it grows.
"""

from __future__ import annotations

import dataclasses

_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
# Number states that may end the number (the others need another character).
_NUMBER_ENDS = {"zero", "int", "frac", "exp"}


@dataclasses.dataclass
class Member:
    """A top-level member: `text[key_start:key_end]` is its key (a JSON string, quotes
    included); its value starts at `value_start` and ends at `value_end` (None while
    it is still being written)."""

    key_start: int
    key_end: int = -1
    value_start: int = -1
    value_end: int | None = None


class JsonObject:
    """Checks one JSON object (leading whitespace not included) as its text arrives."""

    def __init__(self):
        self.text = ""  # what was consumed
        self._pos = 0  # its length, while a piece is being consumed
        self.members: list[Member] = []
        self.done = False
        self.error: str | None = None
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = "object"  # what the next character may be
        self._string_is_key = False
        self._unicode = 0  # hex digits left of a \uXXXX escape
        self._number = ""  # the number's state while in one
        self._literal = ""  # characters left of true/false/null
        self._escape = False  # the last character was a backslash in a string

    def feed(self, text: str) -> int:
        """Consumes `text` while it keeps a valid prefix; returns how many characters
        it took (fewer than given once `done` or `error`)."""
        taken = 0
        for c in text:
            if self.done or self.error is not None:
                break
            if not self._step(c):
                self.error = f"unexpected {c!r} at {self._pos}"
                break
            self._pos += 1
            taken += 1
        self.text += text[:taken]
        return taken

    @property
    def in_progress(self) -> bool:
        return not self.done and self.error is None

    # ------------------------------------------------------------------ the machine

    def _step(self, c: str) -> bool:
        pos = self._pos
        e = self._expect
        if e == "string":
            return self._string(c, pos)
        if e == "number":
            if self._number_step(c):
                return True
            if self._number not in _NUMBER_ENDS:
                return False
            self._value_end(pos)  # the number ended just before `c`
            return self._step(c)
        if e == "literal":
            if c != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._value_end(pos + 1)
            return True
        if c in _WS:
            return e != "object"  # the object itself starts at its brace
        if e == "object":
            if c != "{":
                return False
            self._stack.append("{")
            self._expect = "key_or_end"
            return True
        if e in ("key_or_end", "key"):
            if c == "}" and e == "key_or_end":
                return self._close(c, pos)
            if c != '"':
                return False
            if len(self._stack) == 1:
                self.members.append(Member(key_start=pos))
            self._string_is_key = True
            self._expect = "string"
            return True
        if e == "colon":
            if c != ":":
                return False
            self._expect = "value"
            return True
        if e == "comma_or_end":
            if c == ",":
                self._expect = "key" if self._stack[-1] == "{" else "value"
                return True
            return self._close(c, pos)
        if e == "value_or_end" and c == "]":
            return self._close(c, pos)
        return self._value_start(c, pos)  # "value" or "value_or_end"

    def _value_start(self, c: str, pos: int) -> bool:
        if not (c in '{["-' or c in _DIGITS or c in _LITERALS):
            return False  # (no value starts here: nothing recorded, nothing consumed)
        if len(self._stack) == 1 and self._stack[0] == "{":
            self.members[-1].value_start = pos
        if c in "{[":
            self._stack.append(c)
            self._expect = "key_or_end" if c == "{" else "value_or_end"
        elif c == '"':
            self._string_is_key = False
            self._expect = "string"
        elif c == "-" or c in _DIGITS:
            self._number = "sign" if c == "-" else ("zero" if c == "0" else "int")
            self._expect = "number"
        elif c in _LITERALS:
            self._literal = _LITERALS[c][1:]
            self._expect = "literal"
        else:
            return False
        return True

    def _close(self, c: str, pos: int) -> bool:
        if not self._stack or c != {"{": "}", "[": "]"}[self._stack[-1]]:
            return False
        self._stack.pop()
        if not self._stack:
            self.done = True
            return True
        self._value_end(pos + 1)
        return True

    def _value_end(self, end: int) -> None:
        """A value ended at `end`: a member's, if it sits in the top-level object."""
        if len(self._stack) == 1:
            self.members[-1].value_end = end
        self._expect = "comma_or_end"

    def _string(self, c: str, pos: int) -> bool:
        if self._unicode:
            if c not in _HEX:
                return False
            self._unicode -= 1
            return True
        if self._escape:  # the character after a backslash
            self._escape = False
            if c == "u":
                self._unicode = 4
                return True
            return c in _ESCAPES
        if c == "\\":
            self._escape = True
            return True
        if c == '"':
            if self._string_is_key:
                if len(self._stack) == 1:
                    self.members[-1].key_end = pos + 1
                self._expect = "colon"
            else:
                self._value_end(pos + 1)
            return True
        return ord(c) >= 0x20  # control characters must be escaped

    def _number_step(self, c: str) -> bool:
        """Advances the number's state by `c`; False if `c` does not continue it."""
        s = self._number
        if c in _DIGITS:
            nxt = {
                "sign": "zero" if c == "0" else "int",
                "int": "int",
                "frac_start": "frac",
                "frac": "frac",
                "exp_start": "exp",
                "exp_sign": "exp",
                "exp": "exp",
            }.get(s)
        elif c == ".":
            nxt = "frac_start" if s in ("zero", "int") else None
        elif c in "eE":
            nxt = "exp_start" if s in ("zero", "int", "frac") else None
        elif c in "+-":
            nxt = "exp_sign" if s == "exp_start" else None
        else:
            nxt = None
        if nxt is None:
            return False
        self._number = nxt
        return True
