"""Generated token ids -> the text pieces a client receives (kvbook.serving.server streams them).

A token may end in the middle of a UTF-8 character, and a stop string may span tokens: both are held back until
they are complete. Explained in chapter 10 ("Serving").
"""

from __future__ import annotations

from ..tokenizer import EOS_IDS, Tokenizer


class TextStream:
    """Turns generated token ids into text pieces: holds back an incomplete UTF-8 character and anything that
    could still become a stop string, and reports a stop string once it appears."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters already given out
        self.stopped = False

    def add(self, token_id: int) -> str:
        if token_id not in EOS_IDS:
            self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for s in self.stop:
            if s in text:
                self.stopped = True
                text = text[:text.index(s)]
                return self._emit(text, len(text))
        safe = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character decodes as U+FFFD
        if self.stop:
            safe = min(safe, len(text) - max(len(s) for s in self.stop) + 1)
        return self._emit(text, safe)

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        return self._emit(text, len(text))

    def _emit(self, text: str, upto: int) -> str:
        piece = text[self.sent:max(upto, self.sent)]
        self.sent += len(piece)
        return piece
