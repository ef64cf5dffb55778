"""Whisper's tokenizer: GPT-2's byte-level BPE from tokenizer.json plus Whisper's special
tokens, found by their text in the file (their ids differ between the English-only,
multilingual and large-v3 vocabularies):

- <|endoftext|> (end of transcript), <|startoftranscript|>, <|startofprev|> (a prompt or
  the previous window's text comes after it), <|nospeech|> (<|nocaptions|> in older
  files: its probability after the task token is the no-speech probability);
- one token per language (<|en|>, <|de|>, ...), <|transcribe|>, <|translate|>;
- <|notimestamps|>, then <|0.00|> .. <|30.00|> (every 0.02 s) from the id after it.

A window's decoder starts from `sot_sequence`: <|startoftranscript|>, the language, the
task, and <|notimestamps|> unless timestamps are wanted.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from infire.errors import InvalidRequestError, ModelLoadError

# ISO 639-1 codes in Whisper's order (its language tokens follow <|startoftranscript|> in
# this order; vocabularies before large-v3 stop before "yue"), with English names
LANGUAGES = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian",
    "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian",
    "sw": "swahili", "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala",
    "km": "khmer", "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans",
    "oc": "occitan", "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi",
    "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek",
    "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk",
    "mt": "maltese", "sa": "sanskrit", "lb": "luxembourgish", "my": "myanmar",
    "bo": "tibetan", "tl": "tagalog", "mg": "malagasy", "as": "assamese", "tt": "tatar",
    "haw": "hawaiian", "ln": "lingala", "ha": "hausa", "ba": "bashkir", "jw": "javanese",
    "su": "sundanese", "yue": "cantonese",
}  # fmt: skip
TIME_PRECISION = 0.02  # seconds a timestamp token stands for


class WhisperTokenizer:
    def __init__(self, path: Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"{path.parent}: no tokenizer.json for Whisper")
        self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        ids = {
            token.content: token_id
            for token_id, token in self.tokenizer.get_added_tokens_decoder().items()
        }

        def special(*names: str) -> int:
            for name in names:
                if name in ids:
                    return ids[name]
            raise ModelLoadError(f"{path}: Whisper's {names[0]} is not in the vocabulary")

        self.eot = special("<|endoftext|>")
        self.sot = special("<|startoftranscript|>")
        self.sot_prev = special("<|startofprev|>")
        self.no_speech = special("<|nospeech|>", "<|nocaptions|>")
        self.transcribe = special("<|transcribe|>")
        self.translate = special("<|translate|>")
        self.no_timestamps = special("<|notimestamps|>")
        self.timestamp_begin = self.no_timestamps + 1
        self.languages = {code: ids[f"<|{code}|>"] for code in LANGUAGES if f"<|{code}|>" in ids}
        self.vocab_size = self.tokenizer.get_vocab_size()

    @property
    def multilingual(self) -> bool:
        return len(self.languages) > 1

    def language_token(self, language: str) -> int:
        code = language.lower()
        if code not in self.languages:
            names = {name: c for c, name in LANGUAGES.items()}
            code = names.get(code, code)
        if code not in self.languages:
            raise InvalidRequestError(
                f"language {language!r} is not one this model knows (ISO 639-1 codes such as 'en', 'de')",
                param="language",
            )
        return self.languages[code]

    def language_of(self, token: int) -> str:
        for code, token_id in self.languages.items():
            if token_id == token:
                return code
        raise KeyError(token)

    def sot_sequence(
        self, language: str | None, task: str = "transcribe", timestamps: bool = False
    ) -> list[int]:
        """<|startoftranscript|>, the language (left out where None: detect it first), the
        task, and <|notimestamps|> unless timestamps are wanted."""
        out = [self.sot]
        if self.multilingual:
            if language is not None:
                out.append(self.language_token(language))
            out.append(self.translate if task == "translate" else self.transcribe)
        if not timestamps:
            out.append(self.no_timestamps)
        return out

    def encode(self, text: str) -> list[int]:
        """Text tokens, no special tokens (a prompt or prefix: give it its leading space)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of the tokens below <|endoftext|> (timestamps and specials dropped)."""
        return self.tokenizer.decode([i for i in ids if i < self.eot], skip_special_tokens=False)

    def timestamp(self, token: int) -> float:
        return round((token - self.timestamp_begin) * TIME_PRECISION, 2)
