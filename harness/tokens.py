"""The model's tokenizer (`--tokenizer DIR`), for servers that report no token ids.

Counts then come from tokenising the text a server streamed, which every record marks as
`count_source: tokenizer`: exact only when the server's detokenisation round-trips, so ids
from the server are always preferred. Loads `DIR/tokenizer.json` with the `tokenizers`
package (no torch, no transformers).
"""

from __future__ import annotations

from pathlib import Path


class TextTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
        self.path = str(path)
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the tokenizers package raises a bare Exception
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(
                f"--tokenizer {path}: {file} is not a tokenizer the tokenizers package reads ({reason})"
            ) from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])
