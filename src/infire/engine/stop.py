"""Appending a sampled token to a sequence: detokenize, record logprobs, check stops.

Stop strings are matched on the detokenized text across token boundaries, and the last
len(longest stop) - 1 characters are held back from the output until they cannot be the
start of a stop string, so a stop string is never emitted, not even in part.
"""

from __future__ import annotations

from infire.engine.request import Sequence
from infire.engine.structured import advance
from infire.layers.sampler import SamplerOutput
from infire.outputs import Logprob
from infire.tokenizer import Tokenizer


def append_token(
    seq: Sequence, output: SamplerOutput, row: int, tokenizer: Tokenizer, max_model_len: int
) -> None:
    """Add row `row` of `output` to `seq` and finish it if a stop condition holds."""
    token = output.token_ids[row]
    seq.token_ids.append(token)
    if seq.logprobs is not None:
        _record_logprobs(seq, output, row, tokenizer)
    delta = seq.detokenizer.step(seq.output_token_ids)
    seq.text += delta
    params = seq.params
    complete = seq.matcher is not None and advance(seq.matcher, token)
    if not params.ignore_eos and token in tokenizer.eos_token_ids:
        seq.finish("stop")
    elif token in params.stop_token_ids:
        seq.finish("stop", token)
    elif params.stop and _check_stop_strings(seq, len(delta)):
        pass
    elif complete:  # the grammar is done: nothing else may follow
        seq.finish("stop")
    elif _out_of_room(seq, max_model_len):
        seq.finish("length")
    _update_emitted(seq)


def _out_of_room(seq: Sequence, max_model_len: int) -> bool:
    limit = seq.params.max_tokens
    return (limit is not None and seq.num_output_tokens >= limit) or len(
        seq.token_ids
    ) >= max_model_len


def _check_stop_strings(seq: Sequence, delta_len: int) -> bool:
    longest = max(len(s) for s in seq.params.stop)
    search_from = max(0, len(seq.text) - delta_len - longest + 1)
    found = [
        (index, stop)
        for stop in seq.params.stop
        if (index := seq.text.find(stop, search_from)) != -1
    ]
    if not found:
        return False
    index, stop = min(found)
    end = index + len(stop) if seq.params.include_stop_str_in_output else index
    seq.text = seq.text[:end]
    seq.finish("stop", stop)
    return True


def _update_emitted(seq: Sequence) -> None:
    if seq.finished or not seq.params.stop:
        seq.num_emitted_chars = len(seq.text)
        return
    hold = max(len(s) for s in seq.params.stop) - 1
    seq.num_emitted_chars = max(seq.num_emitted_chars, len(seq.text) - hold)


def _record_logprobs(seq: Sequence, output: SamplerOutput, row: int, tokenizer: Tokenizer) -> None:
    token = output.token_ids[row]
    sampled = output.sampled_logprobs[row]
    entry = {
        token: Logprob(token, sampled, output.sampled_ranks[row], tokenizer.decode([token], False))
    }
    for rank, (tid, lp) in enumerate(
        zip(
            output.top_token_ids[row][: seq.params.logprobs], output.top_logprobs[row], strict=False
        ),
        1,
    ):
        if tid not in entry:
            entry[tid] = Logprob(tid, lp, rank, tokenizer.decode([tid], False))
    seq.logprobs.append(entry)
    seq.cumulative_logprob += sampled
