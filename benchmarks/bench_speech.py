"""Speech: infire's Whisper against faster-whisper (CTranslate2, int8 and float32) and
transformers, on the same Whisper base weights and the same audio, in one run.

Audio: espeak-ng sentences (tests/speech_clips.py) joined with short pauses into 30 s
clips, 8 different ones. Every engine decodes greedily in English (openai-whisper's
fallback where the engine has it), with 2 threads, each in a fresh process.

Measures:
- batch-1 real-time factor: seconds to transcribe one 30 s clip over 30 (lower is better);
- 8 clips at once: audio seconds transcribed per second of wall time (infire: 8 requests
  to one SpeechEngine, which batches their windows; faster-whisper: 8 threads on one
  model; transformers: one generate call on a batch of 8);
- peak RSS above the process's baseline after imports;
- infire's engine thread in the 8-clip run: windows encoded, seconds in the encoder and in
  the decoder (steps, fallbacks, language detection);
- realtime (infire only: the peers have no realtime route): `infire serve`'s
  /v1/realtime?intent=transcription over a WebSocket, 6 utterances streamed as PCM16 at
  real-time pace in 100 ms chunks, each followed by 1.5 s of silence; per turn the time from
  the end of its speech (its last chunk with speech sent) to `speech_stopped` (the server
  VAD's 500 ms of silence, at the pace of the audio) and to `.completed`.

    .venv/bin/python benchmarks/bench_speech.py        # ~10 minutes on 2 cores

Results: benchmarks/results/speech.json and docs/benchmarks-speech.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_gguf import _status  # /proc/self/status fields, as that benchmark reads them

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ENGINES = ["infire", "faster-whisper int8", "faster-whisper float32", "transformers"]
THREADS = 2
CLIPS = 8


def clips() -> list[tuple[Path, str]]:
    """8 clips of 30 s (cached): sentences in turn, each clip starting at another one."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    from infire.audio import SAMPLE_RATE, decode_audio
    from speech_clips import SENTENCES, VOICES, encode_as, espeak

    folder = RESULTS / "speech"
    folder.mkdir(parents=True, exist_ok=True)
    voices = []
    for i, text in enumerate(SENTENCES):
        path = folder / f"s{i}.wav"
        if not path.exists():
            espeak(text, path, *VOICES[i % len(VOICES)])
        voices.append((decode_audio(path), text))
    pause = np.zeros(SAMPLE_RATE * 6 // 10, np.float32)
    out = []
    for c in range(CLIPS):
        parts, texts, i = [], [], c
        while sum(p.size for p in parts) < 29 * SAMPLE_RATE:
            audio, text = voices[i % len(voices)]
            parts += [audio, pause]
            texts.append(text)
            i += 1
        samples = np.concatenate(parts)[: 30 * SAMPLE_RATE]
        path = folder / f"clip{c}.wav"
        path.write_bytes(encode_as(samples, SAMPLE_RATE, "wav", "pcm_s16le"))
        out.append((path, " ".join(texts)))
    return out


def child(engine: str, paths: list[str]) -> dict:
    """One engine: load, one clip alone (twice: the second is timed), then 8 at once."""
    import torch

    torch.set_num_threads(THREADS)
    import numpy as np

    from infire.audio import decode_audio
    from infire.models.whisper import whisper_base_path

    audio = [decode_audio(p) for p in paths]
    base = _status("VmRSS")
    if engine == "infire":
        import asyncio

        from infire.engine.speech import SpeechEngine
        from infire.speech import TranscribeOptions

        speech = SpeechEngine(whisper_base_path())
        options = TranscribeOptions(language="en")

        async def run(batch: list[np.ndarray]) -> list[str]:
            jobs = [speech.job(a, options) for a in batch]
            return [r.text for r in await asyncio.gather(*(speech.transcribe(j) for j in jobs))]

        def one(a: np.ndarray) -> str:
            return asyncio.run(run([a]))[0]

        def many(batch: list[np.ndarray]) -> list[str]:
            return asyncio.run(run(batch))
    elif engine.startswith("faster-whisper"):
        from concurrent.futures import ThreadPoolExecutor

        from faster_whisper import WhisperModel

        sys.path.insert(0, str(ROOT / "tests"))
        from speech_clips import faster_whisper_folder

        folder = faster_whisper_folder(RESULTS / "faster-whisper-base")
        model = WhisperModel(str(folder), device="cpu", compute_type=engine.split()[1],
                             cpu_threads=THREADS, num_workers=1)  # fmt: skip

        def one(a: np.ndarray) -> str:
            segments, _ = model.transcribe(a, beam_size=1, language="en")
            return "".join(s.text for s in segments)

        def many(batch: list[np.ndarray]) -> list[str]:
            with ThreadPoolExecutor(len(batch)) as pool:
                return list(pool.map(one, batch))
    else:
        from transformers import WhisperFeatureExtractor

        sys.path.insert(0, str(ROOT / "tests"))
        from whisper_models import whisper_base_in_transformers

        model = whisper_base_in_transformers()
        extractor = WhisperFeatureExtractor()

        def many(batch: list[np.ndarray]) -> list[str]:
            from infire.models.whisper_tokenizer import WhisperTokenizer

            features = extractor(batch, sampling_rate=16000, return_tensors="pt").input_features
            with torch.inference_mode():
                out = model.generate(
                    features, language="en", task="transcribe", do_sample=False, max_new_tokens=440
                )  # the decoder holds 448
            tokenizer = WhisperTokenizer(whisper_base_path() / "tokenizer.json")
            return [tokenizer.decode(row) for row in out.tolist()]

        def one(a: np.ndarray) -> str:
            return many([a])[0]

    loaded = _status("VmRSS")
    one(audio[0])  # warm up
    start = time.perf_counter()
    text = one(audio[0])
    alone = time.perf_counter() - start
    counters = ("windows_encoded", "encoder_seconds", "decoder_seconds")
    before = [getattr(speech, c) for c in counters] if engine == "infire" else []
    start = time.perf_counter()
    texts = many(audio)
    together = time.perf_counter() - start
    # infire: its engine thread's time in the 8-clip run, encoder against decoder
    split = (
        {c: getattr(speech, c) - b for c, b in zip(counters, before, strict=True)} if before else {}
    )
    return {"load_rss": loaded - base, "peak_rss": _status("VmHWM") - base, "alone_s": alone,
            "together_s": together, "text": text, "texts": texts,
            "audio_s": [a.size / 16000 for a in audio], **split}  # fmt: skip


def realtime_latency(turns: int = 6) -> dict:
    """End of an utterance -> `input_audio_buffer.speech_stopped` and -> `...completed`,
    per turn, through a real `infire serve` (see the module's docstring)."""
    import base64
    import tempfile
    import threading

    import numpy as np
    from websockets.sync.client import connect

    from infire.audio import decode_audio
    from infire.serverproc import ServerProcess, free_port

    sys.path.insert(0, str(ROOT / "tests"))
    from speech_clips import SENTENCES, VOICES, espeak

    folder = RESULTS / "speech"
    speech = []
    for i in range(turns):
        path = folder / f"s{i}.wav"
        if not path.exists():
            espeak(SENTENCES[i], path, *VOICES[i % len(VOICES)])
        speech.append(decode_audio(path))
    rate, chunk = 24000, 2400  # OpenAI's pcm16: 24 kHz; 100 ms a chunk

    def pcm(samples: np.ndarray) -> bytes:
        times = np.arange(int(samples.size * rate / 16000)) * 16000 / rate
        up = np.interp(times, np.arange(samples.size), samples)
        return (np.clip(up, -1, 1) * 32767).astype("<i2").tobytes()

    port = free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = ServerProcess("infire serve", [sys.executable, "-m", "infire.cli", "serve", "--port", str(port)],
                           port, f"http://127.0.0.1:{port}/health", log=log, timeout=300)  # fmt: skip
    try:
        with connect(f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription") as ws:
            events: list[tuple[float, dict]] = []
            done = threading.Event()

            def read() -> None:
                while not done.is_set():
                    try:
                        event = json.loads(ws.recv(timeout=1))
                    except TimeoutError:
                        continue
                    except Exception:  # noqa: BLE001 - the socket closed
                        return
                    events.append((time.perf_counter(), event))

            reader = threading.Thread(target=read)
            reader.start()
            ws.send(json.dumps({"type": "session.update", "session": {
                "input_audio_format": "pcm16",
                "input_audio_transcription": {"model": "whisper-base", "language": "en"},
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}))  # fmt: skip
            time.sleep(1.0)
            ends = []
            start = time.perf_counter()
            sent = 0.0  # seconds of audio sent, at the pace of the audio
            for samples in speech:
                audio = pcm(np.concatenate([np.zeros(4800, np.float32), samples]))
                silence = pcm(np.zeros(24000, np.float32))
                for part, is_speech in ((audio, True), (silence, False)):
                    for at in range(0, len(part), 2 * chunk):
                        piece = part[at : at + 2 * chunk]
                        wait = start + sent - time.perf_counter()
                        if wait > 0:
                            time.sleep(wait)
                        ws.send(json.dumps({"type": "input_audio_buffer.append",
                                            "audio": base64.b64encode(piece).decode()}))  # fmt: skip
                        sent += len(piece) / 2 / rate
                    if is_speech:
                        ends.append(time.perf_counter())
            deadline = time.perf_counter() + 60
            while time.perf_counter() < deadline:
                completed = [e for _, e in events if e["type"].endswith("transcription.completed")]
                if len(completed) >= turns:
                    break
                time.sleep(0.1)
            done.set()
            reader.join()
    finally:
        server.stop()
    stopped = [t for t, e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    completed = [t for t, e in events if e["type"].endswith("transcription.completed")]
    texts = [e["transcript"] for _, e in events if e["type"].endswith("transcription.completed")]
    if len(stopped) < turns or len(completed) < turns:
        raise RuntimeError(f"{len(stopped)} turns stopped, {len(completed)} completed of {turns}")
    return {"to_stopped_s": [s - e for s, e in zip(stopped, ends, strict=False)],
            "to_completed_s": [c - e for c, e in zip(completed, ends, strict=False)],
            "stopped_to_completed_s": [c - s for c, s in zip(completed, stopped, strict=False)],
            "texts": texts}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "PATHS"))
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from speech_clips import wer

    chosen = clips()
    paths = json.dumps([str(p) for p, _ in chosen])
    results: dict = {"engines": {}}
    for r in range(args.rounds):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            out = subprocess.run([sys.executable, __file__, "--child", engine, paths],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            got = json.loads(out.stdout.strip().splitlines()[-1])
            got["wer"] = wer([(t, h) for (_, t), h in zip(chosen, got["texts"], strict=True)])
            results["engines"].setdefault(engine, []).append(got)
            print(f"round {r + 1} {engine}: alone {got['alone_s']:.2f} s, 8 at once "
                  f"{got['together_s']:.1f} s, WER {got['wer']:.3f}, peak RSS "
                  f"{got['peak_rss'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
    realtime = realtime_latency()
    results["realtime"] = realtime
    print("realtime, per turn: end of speech -> speech_stopped "
          + ", ".join(f"{t:.2f}" for t in realtime["to_stopped_s"]) + " s; -> completed "
          + ", ".join(f"{t:.2f}" for t in realtime["to_completed_s"]) + " s")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "speech.json").write_text(json.dumps(results, indent=2))
    audio = sum(results["engines"]["infire"][0]["audio_s"])
    rows = {}
    for engine, runs in results["engines"].items():
        alone = statistics.median(g["alone_s"] for g in runs)
        together = statistics.median(g["together_s"] for g in runs)
        rows[engine] = {"rtf": alone / 30, "throughput": audio / together,
                        "wer": statistics.median(g["wer"] for g in runs),
                        "peak_rss_mib": statistics.median(g["peak_rss"] for g in runs) / 2**20}  # fmt: skip
    print("\n| engine | batch-1 RTF (30 s clip) | 8 clips: audio s / s | WER | peak RSS MiB |")
    print("|---|--:|--:|--:|--:|")
    for engine, row in rows.items():
        print(f"| {engine} | {row['rtf']:.3f} | {row['throughput']:.1f} | {row['wer']:.3f} | "
              f"{row['peak_rss_mib']:.0f} |")  # fmt: skip
    int8, fp32 = rows["faster-whisper int8"], rows["faster-whisper float32"]
    print(
        f"\ninfire RTF / faster-whisper int8: {rows['infire']['rtf'] / int8['rtf']:.2f}x (target <= 1.25)"
    )
    print(f"infire throughput / faster-whisper int8: {rows['infire']['throughput'] / int8['throughput']:.2f}x, "
          f"/ float32: {rows['infire']['throughput'] / fp32['throughput']:.2f}x (target >= 2)")  # fmt: skip
    split = results["engines"]["infire"][-1]
    print(f"infire, 8 clips: {split['windows_encoded']} windows, encoder "
          f"{split['encoder_seconds']:.1f} s, decoder {split['decoder_seconds']:.1f} s of "
          f"{split['together_s']:.1f} s; 2x faster-whisper int8 is "
          f"{audio / int8['throughput'] / 2:.1f} s")  # fmt: skip
    print(f"realtime: end of speech -> completed, median "
          f"{statistics.median(realtime['to_completed_s']):.2f} s (speech_stopped -> completed "
          f"{statistics.median(realtime['stopped_to_completed_s']):.2f} s)")  # fmt: skip
    plot(rows)


def plot(rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = list(rows)
    for ax, key, title in zip(axes, ("rtf", "throughput", "peak_rss_mib"),
                              ("batch-1 real-time factor (lower is better)",
                               "8 clips at once: audio s / s", "peak RSS MiB"), strict=True):  # fmt: skip
        ax.bar(range(len(names)), [rows[n][key] for n in names],
               color=["#f38020", "#4a90d9", "#7fb2e5", "#999999"])  # fmt: skip
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n") for n in names], fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle("Whisper base on 2 CPU cores: infire vs faster-whisper vs transformers")
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "benchmarks-speech.png", dpi=100)


if __name__ == "__main__":
    main()
