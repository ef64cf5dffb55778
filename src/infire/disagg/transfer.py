"""KV hand-over between a prefill engine and a decode engine: layout, leases and pulls.

A prefill engine (`--role prefill`) runs a request's prompt, samples its first token and,
instead of decoding on, holds the sequence's KV blocks under a lease and answers with a
handle (`hold`): where its pool lives (the connector's address and each layer plane's
base address), the block ids, a CRC-32 per block, the prompt's hash and the first token.
The lease ends when the decode side confirms (`release`), when it expires (`expire`,
called by the engine loop), or when the request is aborted; the blocks go back to the
pool then (cached prompt blocks stay in the prefix cache).

A decode engine (`--role decode`) takes the request with that handle: it appends the first
token (so it streams at once), takes from its own prefix cache the prompt blocks it holds
already, allocates the rest and pulls only those (`start_pull`), checks their CRC-32s and
only then lets the sequence decode. A mismatch or a failed pull fails that request.

Both sides must lay their pools out alike (same model, dtype, block size and tensor
parallel size): `layout_signature` names the layout, and a handle from another one is
refused. Pools with windowed KV groups (Gemma 3, Llama 4) and sharded engines (TP/PP)
are not transferred yet; `check_transferable` says so.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from infire.disagg.connector import KVConnector, Range, Transfer
from infire.errors import InvalidRequestError
from infire.layers.sampler import SamplerOutput


class BlockRefs(Protocol):
    """What a lease or a pull needs of the engine's block pool: one more holder of a block,
    one fewer (the engine's BlockPool; this module does not reach into the engine)."""

    def reference(self, block: int) -> None: ...

    def release(self, block: int) -> None: ...


ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Where a block's bytes are in a KV pool: one segment per (layer, plane); block b of
    segment s spans [bases[s] + b * block_bytes[s], + block_bytes[s])."""

    bases: list[int]
    block_bytes: list[int]
    num_blocks: int

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], num_blocks: int) -> PoolLayout:
        """The layout of a runner's per-layer KV tensors ([planes, blocks, ...] each)."""
        bases, sizes = [], []
        for cache in kv_caches:
            for plane in cache:
                if not plane.is_contiguous() or plane.shape[0] != num_blocks:
                    raise ValueError("every KV plane must be a contiguous [num_blocks, ...]")
                bases.append(plane.data_ptr())
                sizes.append(plane[0].nbytes)
        return cls(bases, sizes, num_blocks)

    def regions(self) -> list[tuple[int, int]]:
        """The pool as few contiguous (address, bytes) regions as its planes allow."""
        spans = sorted((b, n * self.num_blocks) for b, n in zip(self.bases, self.block_bytes,
                                                                   strict=True))  # fmt: skip
        merged: list[list[int]] = []
        for base, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == base:
                merged[-1][1] += length
            else:
                merged.append([base, length])
        return [(b, n) for b, n in merged]

    def signature(self, block_size: int, dtype: str) -> str:
        """A name for the layout that two engines must share to trade blocks."""
        sizes = ",".join(str(n) for n in self.block_bytes)
        digest = hashlib.sha256(sizes.encode()).hexdigest()[:16]
        return f"block_size={block_size} dtype={dtype} planes={len(self.bases)} bytes={digest}"

    def block_checksum(self, block: int) -> int:
        """CRC-32 of one block's bytes, plane after plane."""
        crc = 0
        for base, size in zip(self.bases, self.block_bytes, strict=True):
            crc = zlib.crc32((ctypes_buffer(base + block * size, size)), crc)
        return crc

    def ranges(
        self, peer: PoolLayout, local_blocks: list[int], peer_blocks: list[int]
    ) -> list[Range]:
        """(local address, peer address, bytes) to copy peer_blocks into local_blocks, runs
        of consecutive blocks on both sides merged into one range per plane."""
        runs: list[tuple[int, int, int]] = []  # local start, peer start, blocks
        for lb, pb in zip(local_blocks, peer_blocks, strict=True):
            if runs and runs[-1][0] + runs[-1][2] == lb and runs[-1][1] + runs[-1][2] == pb:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((lb, pb, 1))
        out = []
        for s, size in enumerate(self.block_bytes):
            for lb, pb, count in runs:
                out.append((self.bases[s] + lb * size, peer.bases[s] + pb * size, count * size))
        return out


def ctypes_buffer(address: int, length: int) -> memoryview:
    """A read-only view of `length` bytes at `address` (no copy)."""
    import ctypes

    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def prompt_hash(token_ids: list[int]) -> str:
    """What both sides compare to be sure they tokenized the same prompt."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()


def first_token_fields(output: SamplerOutput, row: int) -> dict:
    """One sampled row as plain values (the first token the decode side appends)."""
    fields: dict = {"token": output.token_ids[row]}
    if output.sampled_logprobs is not None:
        fields |= {
            "logprob": output.sampled_logprobs[row], "rank": output.sampled_ranks[row],
            "top_ids": output.top_token_ids[row], "top_logprobs": output.top_logprobs[row],
        }  # fmt: skip
    return fields


def first_token_output(fields: dict) -> SamplerOutput:
    """The one-row SamplerOutput that `first_token_fields` described."""
    if "logprob" not in fields:
        return SamplerOutput([fields["token"]])
    return SamplerOutput(
        [fields["token"]], [fields["logprob"]], [fields["rank"]], [fields["top_ids"]],
        [fields["top_logprobs"]],
    )  # fmt: skip


def sign(handle: dict, secret: str | None) -> dict:
    """The handle with an HMAC-SHA256 of its contents under the workers' shared secret (as
    it is without one). The balancer's `prefill_url` is not covered."""
    if not secret:
        return handle
    return handle | {"signature": _signature(handle, secret)}


def _signature(handle: dict, secret: str) -> str:
    signed = {k: v for k, v in handle.items() if k not in ("signature", "prefill_url")}
    text = json.dumps(signed, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


def check_kv_params(
    role: str, params: dict | None, token_ids: list[int], n: int, layout: str,
    *, secret: str | None = None, vocab_size: int | None = None, logprobs: bool = False,
) -> None:  # fmt: skip
    """Refuse, before anything is queued, a request whose kv_transfer_params do not fit
    this engine's role (InvalidRequestError naming the field). With a shared `secret` a
    decode engine takes only handles that a prefill engine with the same secret signed:
    pulled blocks enter its prefix cache, so a forged handle must not get there."""
    field_name = "kv_transfer_params"
    if role == "both":
        if params is not None:
            raise InvalidRequestError(
                f"{field_name} is for disaggregated workers; this server runs --role both",
                param=field_name,
            )
        return
    if params is None:
        raise InvalidRequestError(
            f"this server runs --role {role}: it serves the {role} leg of requests that "
            "`infire balance` splits; send requests to the balancer",
            param=field_name,
        )
    if n != 1:
        raise InvalidRequestError(
            "n > 1 is not disaggregated; the balancer sends it to a colocated worker", param="n"
        )
    if role == "prefill":
        if params.get("do_remote_decode") is not True:
            raise InvalidRequestError(
                f'a prefill worker takes {field_name} {{"do_remote_decode": true}}',
                param=field_name,
            )
        return
    first = params.get("first")
    if not isinstance(first, dict) or not isinstance(first.get("token"), int):
        raise InvalidRequestError(
            f"{field_name} lacks the prefill worker's first token", param=field_name
        )
    if secret and not hmac.compare_digest(str(params.get("signature")),
                                          _signature(params, secret)):  # fmt: skip
        raise InvalidRequestError(
            f"{field_name} is not signed by a prefill worker with this worker's --kv-secret",
            param=field_name,
        )
    if vocab_size is not None and not 0 <= first["token"] < vocab_size:
        raise InvalidRequestError(f"{field_name}' first token is not in the vocabulary",
                                  param=field_name)  # fmt: skip
    if logprobs and not all(k in first for k in ("logprob", "rank", "top_ids", "top_logprobs")):
        raise InvalidRequestError(
            f"{field_name}' first token has no logprobs, but the request asks for them",
            param=field_name,
        )
    if params.get("lease") is None:
        return  # the first token ended the request (the engine checks): nothing to pull
    need = ("engine", "layout", "bases", "block_ids", "checksums", "num_tokens", "prompt_hash")
    missing = [k for k in need if k not in params]
    if missing:
        raise InvalidRequestError(f"{field_name} lacks {', '.join(missing)}", param=field_name)
    if params["layout"] != layout:
        raise InvalidRequestError(
            f"the prefill worker's KV layout ({params['layout']}) is not this worker's "
            f"({layout}): prefill and decode workers must serve the same model with the same "
            "dtype, block size and tensor-parallel size (heterogeneous tensor parallelism is "
            "not supported)",
            param=field_name,
        )
    if params["prompt_hash"] != prompt_hash(token_ids) or params["num_tokens"] != len(token_ids):
        raise InvalidRequestError(
            "the prompt tokenizes differently here than on the prefill worker (another model "
            "or chat template?)",
            param=field_name,
        )
    block_size = int(layout.split()[0].removeprefix("block_size="))
    planes = int(layout.split()[2].removeprefix("planes="))
    blocks = -(-len(token_ids) // block_size)
    if len(params["bases"]) != planes or not all(isinstance(b, int) for b in params["bases"]):
        raise InvalidRequestError(f"{field_name}' pool addresses do not match its layout",
                                  param=field_name)  # fmt: skip
    if len(params["block_ids"]) != blocks or len(params["checksums"]) != blocks:
        raise InvalidRequestError(
            f"{field_name}' block list does not cover the prompt", param=field_name
        )


@dataclass(slots=True)
class Lease:
    """Blocks held for a decode engine to pull."""

    lease_id: str
    request_id: str
    block_ids: list[int]
    expires: float


@dataclass(slots=True)
class Pull:
    """A decode-side copy in progress: the blocks it fills (held until it ends)."""

    request_id: str
    transfer: Transfer
    local_blocks: list[int]
    checksums: list[int]  # expected, one per local block


@dataclass(slots=True)
class TransferCounters:
    """What went through this engine's connector since it started."""

    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    pulls: int = 0
    pulls_failed: int = 0
    blocks_pulled: int = 0
    blocks_reused: int = 0  # prompt blocks the decode side's prefix cache already held
    bytes_pulled: int = 0
    pull_seconds: float = 0.0


@dataclass(slots=True)
class KVTransfer:
    """One engine's side of disaggregation: its connector, pool layout and leases."""

    role: str
    connector: KVConnector
    layout: PoolLayout
    pool: BlockRefs
    signature: str
    lease_seconds: float = 30.0
    leases: dict[str, Lease] = field(default_factory=dict)
    counters: TransferCounters = field(default_factory=TransferCounters)

    def __post_init__(self) -> None:
        self.connector.register(self.layout.regions())

    # -- prefill side ------------------------------------------------------------------

    def hold(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> dict:
        """Lease the blocks (one more reference each) and describe them for a puller."""
        lease = Lease(uuid.uuid4().hex, request_id, list(block_ids),
                      time.monotonic() + self.lease_seconds)  # fmt: skip
        for block in block_ids:
            self.pool.reference(block)
        self.leases[lease.lease_id] = lease
        self.counters.leases_granted += 1
        return {
            "engine": self.connector.address, "connector": self.connector.name,
            "lease": lease.lease_id, "layout": self.signature, "bases": self.layout.bases,
            "block_ids": lease.block_ids,
            "checksums": [self.layout.block_checksum(b) for b in block_ids],
            "num_tokens": len(token_ids), "prompt_hash": prompt_hash(token_ids),
            "lease_seconds": self.lease_seconds,
        }  # fmt: skip

    def release(self, lease_id: str) -> bool:
        """End a lease (the decode side has its copy, or gave up); False if unknown."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self._free(lease)
        self.counters.leases_released += 1
        return True

    def release_request(self, request_id: str) -> None:
        """End the leases of an aborted request."""
        for lease in [x for x in self.leases.values() if x.request_id == request_id]:
            self.release(lease.lease_id)

    def expire(self, now: float | None = None) -> int:
        """End every lease past its time; returns how many."""
        now = time.monotonic() if now is None else now
        late = [lease for lease in self.leases.values() if lease.expires <= now]
        for lease in late:
            del self.leases[lease.lease_id]
            self._free(lease)
        self.counters.leases_expired += len(late)
        return len(late)

    def next_expiry(self) -> float | None:
        """Seconds until the next lease expires (None: no lease)."""
        if not self.leases:
            return None
        return max(0.0, min(x.expires for x in self.leases.values()) - time.monotonic())

    @property
    def leased_blocks(self) -> int:
        """Blocks held for pullers (a block in two leases counts twice)."""
        return sum(len(x.block_ids) for x in self.leases.values())

    def _free(self, lease: Lease) -> None:
        for block in reversed(lease.block_ids):
            self.pool.release(block)

    # -- decode side -------------------------------------------------------------------

    def start_pull(
        self, request_id: str, handle: dict, local_blocks: list[int], start: int
    ) -> Pull | None:
        """Pull the handle's blocks from index `start` on into `local_blocks` (the earlier
        ones came from the prefix cache); None when there is nothing to pull. The local
        blocks are referenced until the pull ends, so an abort cannot hand them to another
        sequence while they are being written."""
        self.counters.blocks_reused += start
        peer_blocks = handle["block_ids"][start:]
        if not peer_blocks:
            return None
        targets = local_blocks[start:]
        for block in targets:
            self.pool.reference(block)
        peer = PoolLayout(handle["bases"], self.layout.block_bytes, self.layout.num_blocks)
        ranges = self.layout.ranges(peer, targets, peer_blocks)
        self.counters.pulls += 1
        return Pull(request_id, self.connector.pull(handle["engine"], ranges), targets,
                    handle["checksums"][start:])  # fmt: skip

    def finish_pull(self, pull: Pull) -> str | None:
        """Check a finished pull (its error, or a block whose CRC-32 differs), count it and
        drop its hold on the blocks; returns why it failed, or None."""
        error = pull.transfer.error
        if error is None:
            for i, (block, expected) in enumerate(zip(pull.local_blocks, pull.checksums,
                                                      strict=True)):  # fmt: skip
                if self.layout.block_checksum(block) != expected:
                    error = f"KV block {i} of the transfer arrived with a wrong checksum"
                    break
        for block in reversed(pull.local_blocks):
            self.pool.release(block)
        c = self.counters
        if error is None:
            c.blocks_pulled += len(pull.local_blocks)
            c.bytes_pulled += pull.transfer.num_bytes
            c.pull_seconds += pull.transfer.seconds
        else:
            c.pulls_failed += 1
        return error

    def close(self) -> None:
        """Stop the connector (leases die with the engine)."""
        self.connector.close()
