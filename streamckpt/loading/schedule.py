"""One rank's part of a plan's rounds, and where each round's buffers sit in its arena.

``local_schedule`` picks from a ``LoadPlan`` the reads this rank performs and the
messages it sends and receives in every round; ``layout`` places a round's fetched
bytes (only the staged spans of a read that lands in its targets), decoded bytes,
packed messages and receive buffers in one arena, each piece keeping its file
offset's alignment so typed views stay aligned. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping

from ..plan.data import (ALIGN, Copy, LoadPlan, PlanOptions, Read, holders_of, is_packed, message_layout,
                         message_size, messages_of, wire_length)
from ..plan.routes import read_links
from .landing import ReadLanding


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


DIRECT_MESSAGE_BYTES = PlanOptions().direct_message_bytes  # a contiguous piece this large travels alone


@dataclass(slots=True)
class Message:
    peer: int
    read_index: int
    copies: list[Copy]
    relayed: bool = False  # a send from this rank's relay buffer (bytes it received the round before)
    keep: bool = False  # a receive this rank sends on next round: copied into that round's relay buffer
    part: int = 0  # which of the messages of one read between this rank and ``peer`` (``split_message``)

    @property
    def key(self) -> tuple[int, int, int]:
        """The message's buffers in a round's layout: (read, peer, part)."""
        return self.read_index, self.peer, self.part


def split_message(copies: list[Copy], direct_bytes: int = DIRECT_MESSAGE_BYTES) -> list[list[Copy]]:
    """The messages that carry one read's ``copies`` from its reader to one peer.

    Each piece of at least ``direct_bytes`` of elements goes alone, and its receiver can take
    it straight into its target (``landing.receive_targets``): a contiguous one (its bytes in
    the staged read are its elements, back to back) is sent from the staged read, a strided
    one (a column slice of rows) is packed alone, its elements then back to back as a
    row-major target holds them. Together the rest go as one packed message, as before.
    Without this, a read spanning several tensors (a safetensors file read whole) reached
    every peer packed: a copy into a pack buffer on the sender and one out of the receive
    buffer on the receiver, for most of a replicated load's bytes (issue 37 item 5), and of a
    reshard by columns (issue 43). Sender and receiver split alike (the same copies, in the
    order of the read); several messages to one peer with one tag are matched in order.
    """
    if len(copies) == 1:
        return [copies]
    goes_alone = [wire_length(c) >= direct_bytes for c in copies]
    if not any(goes_alone):
        return [copies]
    rest = [c for c, alone in zip(copies, goes_alone) if not alone]
    return [[c] for c, alone in zip(copies, goes_alone) if alone] + ([rest] if rest else [])


@dataclass(slots=True)
class LocalRound:
    reads: list[tuple[int, Read]] = field(default_factory=list)  # (global read index, read)
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)
    carry: list[int] = field(default_factory=list)  # relayed reads this rank sends again next round

    def is_empty(self) -> bool:
        return not (self.reads or self.sends or self.recvs)


def local_schedule(plan: LoadPlan, rank: int, direct_bytes: int = DIRECT_MESSAGE_BYTES) -> list[LocalRound]:
    """This rank's part of every round; ``direct_bytes``: see ``split_message`` (the same on
    every rank)."""
    rounds = [LocalRound() for _ in range(plan.num_rounds)]
    for i, r in enumerate(plan.reads):
        if r.relay:
            _relayed(rounds, rank, i, r, plan)
            continue
        if r.reader == rank:
            rounds[r.round].reads.append((i, r))
            for peer, copies in sorted(messages_of(r, plan.targets).items()):
                for part, piece in enumerate(split_message(copies, direct_bytes)):
                    rounds[r.round].sends.append(Message(peer, i, piece, part=part))
        elif not r.private:
            mine = [c for c in r.copies if rank in plan.targets[c.target].needers]
            if mine:
                for part, piece in enumerate(split_message(mine, direct_bytes)):
                    rounds[r.round].recvs.append(Message(r.reader, i, piece, part=part))
    return rounds


def _relayed(rounds: list[LocalRound], rank: int, i: int, r: Read, plan: LoadPlan) -> None:
    """This rank's part of a relayed read: its fetch, the round it receives the piece in, and
    the rounds it sends it on in (``routes.read_links``). Between two rounds it sends in, the
    piece is carried into the next round's relay buffer."""
    if rank not in holders_of(r, plan.targets):
        return
    got, sends = read_links(r, plan.targets, rank)
    depths = {d for d, _ in sends}
    if got is None:
        rounds[r.round].reads.append((i, r))
    else:
        rounds[r.round + got[0]].recvs.append(Message(got[1], i, r.copies, keep=got[0] + 1 in depths))
    for d, peers in sends:
        for x in peers:
            rounds[r.round + d].sends.append(Message(x, i, r.copies, relayed=got is not None or d > 0))
        if d + 1 in depths:
            rounds[r.round + d].carry.append(i)


def relayed_pack(rnd: LocalRound, m: Message) -> bool:
    """Whether message ``m`` is a relayed read's (its copies are the read's own list, the same
    for every receiver), whose pack buffer all its receivers share."""
    return any(i == m.read_index and r.relay and m.copies is r.copies for i, r in rnd.reads)


@dataclass(slots=True)
class Layout:
    """Where each buffer of one round lives in its arena."""

    fetch: dict[int, int] = field(default_factory=dict)  # read index -> offset of fetched bytes
    decode: dict[int, int] = field(default_factory=dict)  # read index -> offset of decoded bytes
    spans: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # landing read -> (lo, hi, offset)
    pack: dict[tuple[int, int, int], int] = field(default_factory=dict)  # Message.key -> packed message
    recv: dict[tuple[int, int, int], int] = field(default_factory=dict)  # Message.key -> received message
    relay: dict[int, int] = field(default_factory=dict)  # relayed read -> what this rank sends on
    size: int = 0


def layout(rnd: LocalRound, landings: Mapping[int, ReadLanding] | None = None,
           received_direct: Collection[tuple[int, int, int]] = ()) -> Layout:
    """The round's arena layout; a read in ``landings`` stages only its spans outside targets,
    and a message in ``received_direct`` (received into its target) takes no receive buffer."""
    lay = Layout()
    landings = landings or {}
    pos = 0
    for i, r in rnd.reads:
        land = landings.get(i)
        if land is not None:
            staged = lay.spans[i] = []
            for lo, hi, mem in land.spans:
                if mem is None:
                    pos = align(pos) + (r.start + lo) % ALIGN
                    staged.append((lo, hi, pos))
                    pos += hi - lo
            continue
        # fetched bytes keep the file offset's alignment so typed views stay aligned
        pos = align(pos) + r.start % ALIGN
        lay.fetch[i] = pos
        pos += r.length
        if r.zstd:
            pos = align(pos)
            lay.decode[i] = pos
            pos += r.staging
    for m in rnd.sends:
        if m.relayed:
            if m.read_index not in lay.relay:
                pos = align(pos)
                lay.relay[m.read_index] = pos
                pos += message_size(m.copies)
        elif is_packed(m.copies):
            shared = next((at for (i, _, _), at in lay.pack.items() if i == m.read_index), None) \
                if relayed_pack(rnd, m) else None
            if shared is not None:  # a relayed read: every receiver gets the same message, packed once
                lay.pack[m.key] = shared
                continue
            pos = align(pos)
            lay.pack[m.key] = pos
            pos += message_layout(m.copies)[1]
    for m in rnd.recvs:
        if m.key in received_direct:
            continue
        pos = align(pos)
        lay.recv[m.key] = pos
        pos += message_size(m.copies)
    lay.size = align(pos) + ALIGN
    return lay
