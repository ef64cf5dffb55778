"""Decoding Whisper: a window's tokens from its features, and whole recordings window by
window, as openai-whisper decodes them.

Each step's logits pass the same rules, in this order:
- the model's suppressed tokens (config `suppress_tokens`: symbols and speaker marks that
  Whisper was told never to write) are set to -inf, and at the first sampled position the
  `begin_suppress_tokens` too (a blank " " and <|endoftext|>: a transcript does not start
  empty);
- with timestamps: openai-whisper's timestamp rules (they come in pairs, never go
  backwards, the first is a timestamp at most 1 s in, and where the timestamps together
  are likelier than any text token, a timestamp is taken);
- greedy takes the largest logit (the first of equals, as torch.argmax).

`decode_greedy` runs a batch of greedy windows through a WindowBatcher (engine/speech.py:
continuous batching by the LLM engine's scheduler and block manager, the decoder's
self-attention KV paged), each with its own prompt (tested against transformers' generate
and against each window alone).
`decode_window` decodes one window greedily, by sampling (`best_of` candidates at a
temperature, the likeliest kept) or by beam search (openai-whisper's: beam_size + 1
candidates a beam, patience, finished sequences ranked by their mean log-probability).

`transcribe` runs a recording of any length: 30 s windows from `seek`, each decoded with
the previous windows' text as its prompt (after <|startofprev|>), with openai-whisper's
temperature fallback (a window is decoded again at the next temperature when its text
compresses too well, a loop, or its mean log-probability is too low, unless it is
silence), its no-speech skip, and its timestamps cut into segments; where a window ends
inside speech, the next starts at its last timestamp.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from infire.audio import FRAMES_PER_SECOND, HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE, log_mel
from infire.errors import InvalidRequestError
from infire.models.whisper import LoadedWhisper
from infire.models.whisper_tokenizer import TIME_PRECISION, WhisperTokenizer
from infire.vad import SpeechMap, VadOptions, join_speech, speech_chunks

MAX_INITIAL_TIMESTAMP = 1.0  # seconds: the first timestamp of a window is at most this


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One window's sampled tokens (the prompt excluded, <|endoftext|> dropped), their
    summed log-probability, and the no-speech probability at the first step."""

    tokens: list[int]
    sum_logprob: float
    no_speech_prob: float


class LogitRules:
    """The per-step masks of a window's decoding (see the module's docstring)."""

    def __init__(
        self, tokenizer: WhisperTokenizer, generation: dict, vocab_size: int, timestamps: bool
    ) -> None:
        self.tokenizer, self.timestamps = tokenizer, timestamps
        suppress = [t for t in generation.get("suppress_tokens") or [] if 0 <= t < vocab_size]
        self.suppress = torch.tensor(sorted(set(suppress)), dtype=torch.long)
        begin = generation.get("begin_suppress_tokens")
        if begin is None:
            begin = [tokenizer.encode(" ")[0], tokenizer.eot]
        self.begin = torch.tensor([t for t in begin if 0 <= t < vocab_size], dtype=torch.long)
        self.max_initial = round(MAX_INITIAL_TIMESTAMP / 0.02)

    def apply(self, logits: torch.Tensor, sampled: list[list[int]]) -> torch.Tensor:
        """Mask logits [B, vocab] in place for rows whose sampled tokens so far are
        `sampled[b]`."""
        if self.suppress.numel():
            logits[:, self.suppress] = -torch.inf
        if self.timestamps:
            logits[:, self.tokenizer.no_timestamps] = -torch.inf
        for row, seq in enumerate(sampled):
            if not seq:
                logits[row, self.begin] = -torch.inf
            if self.timestamps:
                self._timestamp_rules(logits[row], seq)
        return logits

    def _timestamp_rules(self, logits: torch.Tensor, seq: list[int]) -> None:
        begin, eot = self.tokenizer.timestamp_begin, self.tokenizer.eot
        last = len(seq) >= 1 and seq[-1] >= begin
        penultimate = len(seq) < 2 or seq[-2] >= begin
        if last:
            if penultimate:  # a pair closed: text (or the end) comes next
                logits[begin:] = -torch.inf
            else:  # a segment's end: another timestamp, or the end
                logits[:eot] = -torch.inf
        stamps = [t for t in seq if t >= begin]
        if stamps:  # never backwards (a segment may end where it starts)
            floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
            logits[begin:floor] = -torch.inf
        else:  # the first sampled token is a timestamp, at most 1 s in
            logits[:begin] = -torch.inf
            logits[begin + self.max_initial + 1 :] = -torch.inf
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if torch.logsumexp(logprobs[begin:], dim=-1) > logprobs[:begin].max():
            logits[:begin] = -torch.inf


@torch.inference_mode()
def decode_greedy(
    whisper: LoadedWhisper,
    tokenizer: WhisperTokenizer,
    features: torch.Tensor,
    prompts: list[list[int]],
    max_new_tokens: int,
    timestamps: bool = False,
    encoded: torch.Tensor | None = None,
) -> list[WindowResult]:
    """Greedy tokens of each window (features [B, n_mels, 3000]) after its prompt (the
    tokens before and including the sot sequence), all in one WindowBatcher."""
    from infire.engine.speech import WindowBatcher  # the engine's batcher, and its scheduler

    encoded = whisper.model.encode(features) if encoded is None else encoded
    kv_tokens = sum(len(prompt) + max_new_tokens for prompt in prompts)
    batcher = WindowBatcher(whisper, tokenizer, len(prompts), kv_tokens)
    for i, prompt in enumerate(prompts):
        batcher.add(i, encoded[i : i + 1], prompt, max_new_tokens, timestamps)
    results: dict[object, WindowResult] = {}
    while batcher.busy:
        results.update(batcher.step())
    return [results[i] for i in range(len(prompts))]


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """How one window is decoded."""

    temperature: float = 0.0
    beam_size: int = 1  # > 1: beam search (at temperature 0)
    best_of: int = 5  # candidates sampled at a temperature > 0
    patience: float = 1.0
    max_new_tokens: int = 224  # half the decoder's 448 positions, as openai-whisper
    timestamps: bool = True
    seed: int = 0


@torch.inference_mode()
def decode_window(
    whisper: LoadedWhisper,
    tokenizer: WhisperTokenizer,
    encoded: torch.Tensor,
    prompt: list[int],
    options: DecodeOptions,
) -> WindowResult:
    """One window (its encoding [1, 1500, d]) decoded after `prompt` by `options`."""
    if options.temperature == 0 and options.beam_size <= 1:
        return decode_greedy(whisper, tokenizer, None, [prompt], options.max_new_tokens,
                             options.timestamps, encoded)[0]  # fmt: skip
    model = whisper.model
    rules = LogitRules(tokenizer, whisper.generation, model.config.vocab_size, options.timestamps)
    width = options.best_of if options.temperature > 0 else options.beam_size
    cache = model.start(encoded.expand(width, -1, -1))
    logits = model.decode(torch.tensor([prompt] * width), cache)
    no_speech = float(
        torch.softmax(logits[0, prompt.index(tokenizer.sot)].float(), -1)[tokenizer.no_speech]
    )
    step = logits[:, -1]
    if options.temperature > 0:
        found = _sample(model, rules, tokenizer, cache, step, width, options)
    else:
        found = _beam(model, rules, tokenizer, cache, step, width, options)
    # the likeliest by mean log-probability (openai-whisper's ranking without a length penalty)
    tokens, score = max(found, key=lambda item: item[1] / max(len(item[0]), 1))
    return WindowResult(list(tokens), score, no_speech)


def _sample(model, rules, tokenizer, cache, step, width, options) -> list[tuple[list[int], float]]:
    generator = torch.Generator().manual_seed(options.seed)
    sampled: list[list[int]] = [[] for _ in range(width)]
    scores = [0.0] * width
    done = [False] * width
    while True:
        step = rules.apply(step.clone(), sampled)
        logprobs = torch.log_softmax(step.float(), dim=-1)
        probs = torch.softmax(step.float() / options.temperature, dim=-1)
        chosen = torch.multinomial(probs, 1, generator=generator)[:, 0]
        for i in range(width):
            if done[i]:
                chosen[i] = tokenizer.eot
                continue
            token = int(chosen[i])
            scores[i] += float(logprobs[i, token])
            if token == tokenizer.eot:
                done[i] = True
            else:
                sampled[i].append(token)
                done[i] = len(sampled[i]) >= options.max_new_tokens
        if all(done):
            return list(zip(sampled, scores, strict=True))
        step = model.decode(chosen[:, None], cache)[:, -1]


def _beam(model, rules, tokenizer, cache, step, width, options) -> list[tuple[list[int], float]]:
    beams: list[list[int]] = [[] for _ in range(width)]
    scores = [0.0] * width
    finished: dict[tuple[int, ...], float] = {}
    wanted = max(1, round(width * options.patience))
    for length in range(options.max_new_tokens):
        step = rules.apply(step.clone(), beams)
        logprobs = torch.log_softmax(step.float(), dim=-1)
        top, ids = logprobs.topk(width + 1, dim=-1)
        candidates: dict[tuple[int, ...], tuple[float, int]] = {}
        # every beam is the same at the first step: its copies add nothing
        for i in range(1 if length == 0 else width):
            for lp, token in zip(top[i].tolist(), ids[i].tolist(), strict=True):
                candidates[(*beams[i], token)] = (scores[i] + lp, i)
        kept: list[tuple[tuple[int, ...], float, int]] = []
        for sequence, (score, source) in sorted(candidates.items(), key=lambda c: -c[1][0]):
            if sequence[-1] == tokenizer.eot:
                if len(finished) < wanted:
                    finished[sequence[:-1]] = score
            elif len(kept) < width:
                kept.append((sequence, score, source))
        if len(finished) >= wanted or not kept:
            break
        cache = cache.select(torch.tensor([source for _, _, source in kept]))
        beams = [list(sequence) for sequence, _, _ in kept]
        scores = [score for _, score, _ in kept]
        step = model.decode(torch.tensor([[b[-1]] for b in beams]), cache)[:, -1]
    if not finished:  # the length ran out: the live beams are the answers
        finished = {tuple(b): s for b, s in zip(beams, scores, strict=True)}
    return [(list(sequence), score) for sequence, score in finished.items()]


@torch.inference_mode()
def detect_language(
    whisper: LoadedWhisper, tokenizer: WhisperTokenizer, encoded: torch.Tensor
) -> tuple[str, dict[str, float]]:
    """The likeliest language of a window (its encoding [1, 1500, d]) and each language's
    probability: the decoder's first step after <|startoftranscript|>, over the language
    tokens alone."""
    if not tokenizer.multilingual:
        return "en", {"en": 1.0}
    logits = whisper.model.decode(torch.tensor([[tokenizer.sot]]), whisper.model.start(encoded))[
        0, -1
    ]
    codes = list(tokenizer.languages)
    probs = torch.softmax(logits[[tokenizer.languages[c] for c in codes]].float(), dim=-1)
    ranked = dict(zip(codes, probs.tolist(), strict=True))
    return codes[int(probs.argmax())], ranked


@dataclass(frozen=True, slots=True)
class TranscribeOptions:
    """openai-whisper's transcribe settings (and faster-whisper's names for them)."""

    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # None: detected on the first window
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    beam_size: int = 1
    best_of: int = 5
    patience: float = 1.0
    initial_prompt: str | None = None
    prefix: str | None = None  # the first window's text starts with this
    condition_on_previous_text: bool = True
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    timestamps: bool = True
    word_timestamps: bool = False
    max_new_tokens: int = 224
    seed: int = 0
    vad_filter: bool = False  # decode the speech only (infire.vad), the recording's times kept
    vad_options: VadOptions = field(default_factory=VadOptions)


@dataclass(frozen=True, slots=True)
class Segment:
    id: int
    seek: int  # the window's first frame
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: tuple[Word, ...] = ()


@dataclass(frozen=True, slots=True)
class Transcription:
    text: str
    language: str
    duration: float  # seconds of audio
    segments: list[Segment] = field(default_factory=list)
    language_probs: dict[str, float] = field(default_factory=dict)
    duration_after_vad: float | None = None  # seconds of speech decoded, with the VAD filter


def compression_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class TranscriptionJob:
    """One recording's transcription, a window at a time: an engine takes each job's
    `window()` features, encodes them (batched with other jobs'), sets the language where
    it is to be detected, decodes the first temperature (batched, greedy) and hands the
    result to `finish_window`, which decodes the higher temperatures alone where the text
    fails the checks and returns the window's new segments."""

    def __init__(self, whisper: LoadedWhisper, tokenizer: WhisperTokenizer, samples: np.ndarray,
                 options: TranscribeOptions | None = None) -> None:  # fmt: skip
        options = options or TranscribeOptions()
        if options.task not in ("transcribe", "translate"):
            raise InvalidRequestError(
                f"task must be 'transcribe' or 'translate', not {options.task!r}", param="task"
            )
        if samples.size == 0:
            raise InvalidRequestError("the audio is empty: it holds no samples", param="file")
        self.whisper, self.tokenizer, self.options = whisper, tokenizer, options
        if options.language is not None:
            tokenizer.language_token(options.language)  # refused here if unknown
        self.duration = samples.size / SAMPLE_RATE
        self.speech: SpeechMap | None = None  # the VAD filter's times, where it is on
        if options.vad_filter:
            chunks = speech_chunks(samples, options.vad_options)
            self.speech = SpeechMap(chunks)
            samples = join_speech(samples, chunks)
        # features of the whole recording (and 30 s of silence after it, as openai-whisper)
        silence = np.zeros(N_SAMPLES, np.float32)
        self.mel = log_mel(
            np.concatenate([samples, silence]), whisper.config.num_mel_bins, pad=False
        )
        self.content_frames = self.mel.shape[-1] - N_FRAMES
        self.language, self.language_probs = options.language, {}
        self.tokens: list[int] = []  # every window's tokens (after the initial prompt)
        if options.initial_prompt:
            self.tokens = tokenizer.encode(" " + options.initial_prompt.strip())
        self.prompt_reset = 0
        self.segments: list[Segment] = []
        self.seek = 0

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames

    @property
    def seconds_done(self) -> float:
        if self.done:
            return self.duration
        return min(self._time(self.seek / FRAMES_PER_SECOND), self.duration)

    def _time(self, seconds: float, end: bool = False) -> float:
        """The recording's time of `seconds` into the decoded audio."""
        return seconds if self.speech is None else self.speech.time(seconds, end)

    def window(self) -> torch.Tensor:
        """The features [n_mels, 3000] of the next window."""
        return self.mel[:, self.seek : self.seek + N_FRAMES]

    def prompt(self) -> list[int]:
        """The decoder's prompt of the next window (the language known)."""
        tokenizer, options = self.tokenizer, self.options
        previous = self.tokens[self.prompt_reset :]
        prompt = []
        if previous:
            keep = self.whisper.config.max_target_positions // 2 - 1
            prompt = [tokenizer.sot_prev, *previous[-keep:]]
        prompt += tokenizer.sot_sequence(self.language, options.task, options.timestamps)
        if options.prefix and self.seek == 0:
            prompt += tokenizer.encode(" " + options.prefix.strip())
        return prompt

    def first_options(self) -> DecodeOptions:
        return self._decode_options(self.options.temperatures[0])

    def _decode_options(self, temperature: float) -> DecodeOptions:
        o = self.options
        return DecodeOptions(temperature=temperature, beam_size=o.beam_size if temperature == 0 else 1,
                             best_of=o.best_of, patience=o.patience, max_new_tokens=o.max_new_tokens,
                             timestamps=o.timestamps, seed=o.seed)  # fmt: skip

    def finish_window(self, encoded: torch.Tensor, first: WindowResult) -> list[Segment]:
        """The window's segments, from the first temperature's result (and the next ones'
        where it fails the checks); the job moves on to the next window."""
        options, tokenizer = self.options, self.tokenizer
        size = min(N_FRAMES, self.content_frames - self.seek)
        prompt = self.prompt()
        result, temperature = first, options.temperatures[0]
        for temperature in options.temperatures:
            if temperature != options.temperatures[0]:
                result = decode_window(self.whisper, tokenizer, encoded, prompt,
                                       self._decode_options(temperature))  # fmt: skip
            if not self._needs_fallback(result):
                break
        avg = result.sum_logprob / (len(result.tokens) + 1)
        silent = (
            options.no_speech_threshold is not None
            and result.no_speech_prob > options.no_speech_threshold
            and (options.logprob_threshold is None or avg <= options.logprob_threshold)
        )
        if silent:  # nothing written, nothing carried
            self.seek += size
            return []
        ratio = compression_ratio(tokenizer.decode(result.tokens))
        found, seek_to = _segments(
            tokenizer, result.tokens, self.seek, size, self.seek / FRAMES_PER_SECOND
        )
        words = self._words(encoded, found, size) if options.word_timestamps else [()] * len(found)
        new = []
        for (start, end, piece), timed in zip(found, words, strict=True):
            text = tokenizer.decode(piece)
            if text.strip():
                start, end = self._time(start), self._time(end, end=True)
                new.append(Segment(len(self.segments) + len(new), self.seek, round(start, 2), round(end, 2),
                                   text, piece, temperature, avg, ratio, result.no_speech_prob, timed))  # fmt: skip
        self.segments += new
        self.tokens += result.tokens
        if not options.condition_on_previous_text or temperature > 0.5:
            self.prompt_reset = len(self.tokens)
        # a window whose last timestamp is its first frame would start again where it did
        self.seek = seek_to if seek_to > self.seek else self.seek + size
        return new

    def _words(self, encoded: torch.Tensor, found: list, frames: int) -> list[tuple[Word, ...]]:
        """Each segment's words, timed by the window's cross-attention alignment."""
        tokenizer = self.tokenizer
        per_segment = [[t for t in piece if t < tokenizer.eot] for _, _, piece in found]
        prompt = tokenizer.sot_sequence(self.language, self.options.task, timestamps=False)
        aligned = align_words(self.whisper, tokenizer, encoded, prompt,
                              [t for piece in per_segment for t in piece], frames,
                              self.language or "en")  # fmt: skip
        offset = self.seek / FRAMES_PER_SECOND
        out, at = [], 0
        for piece in per_segment:
            taken, words = 0, []
            while at < len(aligned) and taken < len(piece):
                word, tokens, start, end, probability = aligned[at]
                words.append(Word(word, round(self._time(offset + start), 2),
                                  round(self._time(offset + end, end=True), 2), round(probability, 4)))  # fmt: skip
                taken += len(tokens)
                at += 1
            out.append(tuple(words))
        return out

    def _needs_fallback(self, result: WindowResult) -> bool:
        options = self.options
        avg = result.sum_logprob / (len(result.tokens) + 1)
        if (
            options.no_speech_threshold is not None
            and result.no_speech_prob > options.no_speech_threshold
        ):
            return False  # silence: another temperature would only invent words
        ratio = options.compression_ratio_threshold
        if ratio is not None and compression_ratio(self.tokenizer.decode(result.tokens)) > ratio:
            return True  # a loop, most likely
        return options.logprob_threshold is not None and avg < options.logprob_threshold

    def result(self) -> Transcription:
        text = "".join(segment.text for segment in self.segments)
        after = None if self.speech is None else round(self.speech.joined_seconds, 3)
        return Transcription(text, self.language or "en", self.duration, list(self.segments),
                             self.language_probs, after)  # fmt: skip


@torch.inference_mode()
def transcribe(
    whisper: LoadedWhisper,
    tokenizer: WhisperTokenizer,
    samples: np.ndarray,
    options: TranscribeOptions | None = None,
    progress: Callable[[float, float], None] | None = None,
) -> Transcription:
    """A recording (16 kHz mono float32) as text and timed segments, window after window;
    `progress(done, total)` in seconds after each window."""
    job = TranscriptionJob(whisper, tokenizer, samples, options)
    while not job.done:
        encoded = whisper.model.encode(job.window()[None])
        if job.language is None:
            job.language, job.language_probs = detect_language(whisper, tokenizer, encoded)
        first = decode_window(whisper, tokenizer, encoded, job.prompt(), job.first_options())
        job.finish_window(encoded, first)
        if progress:
            progress(job.seconds_done, job.duration)
    return job.result()


def _segments(tokenizer: WhisperTokenizer, tokens: list[int], seek: int, size: int, offset: float):
    """A window's tokens cut at its timestamp pairs into (start, end, tokens) segments, and
    the frame the next window starts from."""
    begin = tokenizer.timestamp_begin
    stride = N_FRAMES // 1500  # mel frames a timestamp step covers (2)
    is_stamp = [t >= begin for t in tokens]
    single_ending = len(tokens) >= 2 and is_stamp[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_stamp[i] and is_stamp[i + 1]]
    out = []
    if cuts:
        if single_ending:
            cuts.append(len(tokens))
        last = 0
        for cut in cuts:
            piece = tokens[last:cut]
            start = offset + (piece[0] - begin) * TIME_PRECISION
            end = offset + (piece[-1] - begin) * TIME_PRECISION
            out.append((start, end, piece))
            last = cut
        if single_ending:
            return out, seek + size
        return out, seek + (tokens[last - 1] - begin) * stride
    duration = size * HOP_LENGTH / SAMPLE_RATE
    stamps = [t for t in tokens if t >= begin]
    if stamps and stamps[-1] != begin:
        duration = (stamps[-1] - begin) * TIME_PRECISION
    out.append((offset, offset + duration, tokens))
    return out, seek + size


# -- word timestamps: cross-attention alignment, as openai-whisper's ---------------------

PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
TOKENS_PER_SECOND = 50  # encoder frames a second (a timestamp step is 2 mel frames)
UNSPACED = {"zh", "ja", "th", "lo", "my", "yue"}


@dataclass(frozen=True, slots=True)
class Word:
    word: str
    start: float
    end: float
    probability: float


def alignment_heads(whisper: LoadedWhisper) -> list[tuple[int, int]]:
    """The (layer, head) pairs whose cross-attention follows the audio: the model's own
    list (config `alignment_heads`), else every head of the decoder's second half."""
    heads = whisper.generation.get("alignment_heads")
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    config = whisper.config
    return [(layer, head) for layer in range(config.decoder_layers // 2, config.decoder_layers)
            for head in range(config.decoder_attention_heads)]  # fmt: skip


def _median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of the last axis, the edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    flat = x.reshape(-1, 1, x.shape[-1])
    padded = torch.nn.functional.pad(flat, (pad, pad), mode="reflect").reshape(*x.shape[:-1], -1)
    return padded.unfold(-1, width, 1).median(dim=-1).values


def _dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotone path through cost [tokens, frames]: (token, frame) indices."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0
    trace = np.zeros((n + 1, m + 1), np.int8)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            options = (total[i - 1, j - 1], total[i - 1, j], total[i, j - 1])
            k = int(np.argmin(options))
            total[i, j] = cost[i - 1, j - 1] + options[k]
            trace[i, j] = k
    i, j, path = n, m, []
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        k = trace[i, j]
        if k == 0:
            i, j = i - 1, j - 1
        elif k == 1:
            i -= 1
        else:
            j -= 1
    path.reverse()
    array = np.array(path)
    return array[:, 0], array[:, 1]


def _split_words(tokenizer: WhisperTokenizer, tokens: list[int], language: str) -> list[list[int]]:
    """Tokens grouped into words: a word starts at a token that starts with a space or is
    punctuation (in languages without spaces, at each whole character)."""
    words: list[list[int]] = []
    for token in tokens:
        if token >= tokenizer.eot:
            words.append([token])
            continue
        text = tokenizer.decode([token])
        starts = language in UNSPACED or not words or text.startswith(" ") or text.strip() in (
            APPEND_PUNCTUATION + PREPEND_PUNCTUATION) or words[-1][-1] >= tokenizer.eot  # fmt: skip
        complete = "\\ufffd" not in tokenizer.decode(words[-1]) if words else True
        if starts and complete:
            words.append([token])
        else:
            words[-1].append(token)
    return words


@torch.inference_mode()
def align_words(
    whisper: LoadedWhisper,
    tokenizer: WhisperTokenizer,
    encoded: torch.Tensor,
    prompt: list[int],
    text_tokens: list[int],
    frames: int,
    language: str,
) -> list[tuple[str, list[int], float, float, float]]:
    """(word, tokens, start, end, probability) of a window's text tokens, times in seconds
    from the window's start: the decoder reads [prompt, text, <|endoftext|>] once, the
    alignment heads' cross-attention over the window's `frames` mel frames is normalized
    per frame, median-filtered (7) and averaged, and a monotone path (DTW) through it
    gives each token its first frame."""
    if not text_tokens:
        return []
    model = whisper.model
    tokens = [*prompt, *text_tokens, tokenizer.eot]
    logits: list[torch.Tensor] = []
    out = model.decode(torch.tensor([tokens]), model.start(encoded), logits)
    # each text token's probability among the text tokens, where the decoder wrote it
    probs = torch.softmax(
        out[0, len(prompt) - 1 : len(prompt) - 1 + len(text_tokens), : tokenizer.eot].float(), -1
    )
    token_probs = probs[torch.arange(len(text_tokens)), torch.tensor(text_tokens)]
    weights = torch.stack([logits[layer][0, head] for layer, head in alignment_heads(whisper)])
    weights = weights[:, :, : max(frames // 2, 1)].float().softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = _median_filter((weights - mean) / (std + 1e-9), 7)
    matrix = weights.mean(dim=0)[len(prompt) - 1 : -1]  # the last prompt token's row onward
    text_index, time_index = _dtw(-matrix.double().numpy())
    words = _split_words(tokenizer, [*text_tokens, tokenizer.eot], language)
    boundaries = np.pad(np.cumsum([len(w) for w in words[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_index), (1, 0), constant_values=1).astype(bool)
    jump_times = time_index[jumps] / TOKENS_PER_SECOND
    starts, ends = jump_times[boundaries[:-1]], jump_times[boundaries[1:]]
    found = []
    for word_tokens, start, end, at in zip(words[:-1], starts, ends, boundaries[:-1], strict=True):
        probability = float(token_probs[at : at + len(word_tokens)].mean())
        found.append(
            (tokenizer.decode(word_tokens), word_tokens, float(start), float(end), probability)
        )
    return _merge_punctuation(found)


def _merge_punctuation(words: list) -> list:
    """Opening punctuation joins the next word, closing punctuation the previous one."""
    out = [list(w) for w in words]
    i = len(out) - 2
    while i >= 0:  # prepend, right to left
        if (
            out[i][0].startswith(" ")
            and out[i][0].strip() in PREPEND_PUNCTUATION
            and out[i][0].strip()
        ):
            out[i + 1][0] = out[i][0] + out[i + 1][0]
            out[i + 1][1] = out[i][1] + out[i + 1][1]
            out[i][0], out[i][1] = "", []
        i -= 1
    i = 1
    while i < len(out):  # append, left to right
        if not out[i][0].startswith(" ") and out[i][0] and out[i][0] in APPEND_PUNCTUATION:
            j = i - 1
            while j > 0 and not out[j][0]:
                j -= 1
            out[j][0] = out[j][0] + out[i][0]
            out[j][1] = out[j][1] + out[i][1]
            out[i][0], out[i][1] = "", []
        i += 1
    return [tuple(w) for w in out if w[0]]
