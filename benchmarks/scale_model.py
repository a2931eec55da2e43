"""A load at thousands of GPUs, predicted from the plans the planner really makes.

We cannot run 10,000 GPUs, so this module takes ``build_plan``'s plan for a layout pair
(the all-ranks plan, ``rank=None``, as ``planner_bench`` simulates a job without processes),
counts per rank and round what it asks of the machine (bytes fetched, requests, bytes sent
and received within a node and across nodes, distinct peers, staging), and turns the
counts into a load time with a parameter file of the machine (``configs/scale/*.yaml``,
every figure with its public source). It does the same for two peers' strategies:
every rank reading the stored items it overlaps (DCP's ``FileSystemReader``), and whole
tensors read once and broadcast (Run:ai's distributed streamer). Pure Python: no
torch.distributed, no I/O beyond the YAML. See docs/SCALE.md for what it leaves out.

Which ranks: every rank of the planned world. Large cases plan a documented part of it
(``Case.stages``: only some loaded pipeline stages, exact for their ranks since stages
share no tensor; ``Case.layers``: fewer decoder layers, figures scaled up by bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Collection, Iterable, Sequence

from benchmarks.planner_bench import CHUNK, _flat, _stage, _tp_box, _weights

GB = 1e9
MiB = 1 << 20


# ------------------------------------------------------------------ machine


@dataclass(frozen=True)
class Machine:
    """The figures of ``configs/scale/*.yaml`` (bandwidths in bytes/s)."""

    conn_Bps: float  # one object-store connection's throughput
    first_byte_s: float  # one GET's first-byte latency
    prefix_gets: float  # GETs per second one key prefix takes before SlowDown
    node_store_Bps: float  # a node's bandwidth to the object store
    gpus_per_node: int
    nic_Bps: float  # a node's inter-node (GPU fabric) bandwidth, each way
    nvlink_Bps: float  # one GPU's intra-node bandwidth, each way
    nccl_peer_bytes: int  # GPU memory NCCL keeps per connected peer
    gloo_peer_bytes: int  # host memory gloo keeps per connected peer
    concurrency: dict[str, int]  # strategy -> concurrent GETs per rank
    request_bytes: dict[str, int]  # strategy -> largest GET (0: whole item)
    local_Bps: float = 0.0  # a node's reads of its local tier's files (benchmarks/tier_model.py)


def load_machine(path: str | Path) -> Machine:
    """Read a parameter file; every leaf is ``{value, source}`` (the source is checked by a test)."""
    import yaml

    return machine_from_dict(yaml.safe_load(Path(path).read_text()))


def machine_from_dict(doc: dict[str, Any]) -> Machine:
    """A parameter file's tree (leaves ``{value, source}``) as a Machine (benchmarks/scale_check.py
    builds one from what it measured)."""
    v = {k: e["value"] for k, e in flatten(doc).items()}
    return Machine(
        conn_Bps=v["store.connection_MBps"] * 1e6, first_byte_s=v["store.first_byte_ms"] / 1e3,
        prefix_gets=v["store.prefix_get_per_s"], node_store_Bps=v["node.store_Gbps"] * GB / 8,
        gpus_per_node=int(v["node.gpus"]), nic_Bps=v["node.fabric_Gbps"] * GB / 8,
        nvlink_Bps=v["node.nvlink_GBps_each_way"] * GB, nccl_peer_bytes=int(v["peer.nccl_MiB"] * MiB),
        gloo_peer_bytes=int(v["peer.gloo_MiB"] * MiB),
        concurrency={s: int(v[f"clients.{s}.concurrency"]) for s in STRATEGIES},
        request_bytes={s: int(v[f"clients.{s}.request_MiB"] * MiB) for s in STRATEGIES},
        local_Bps=v.get("node.local_read_GBps", 0.0) * GB)


def flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Dotted name -> ``{value, source}`` leaf of a parameter file."""
    out: dict[str, dict[str, Any]] = {}
    for k, e in doc.items():
        if isinstance(e, dict) and "value" in e:
            out[prefix + k] = e
        elif isinstance(e, dict):
            out.update(flatten(e, prefix + k + "."))
    return out


STRATEGIES = ("streamckpt", "dcp", "runai")


# ------------------------------------------------------------------ the jobs


@dataclass(frozen=True)
class Model:
    """A Llama-style decoder (sizes from its published config.json)."""

    name: str
    layers: int
    hidden: int
    ffn: int
    kv: int  # key/value heads × head dim
    vocab: int

    def weights(self, layers: int | None = None) -> list[tuple[str, tuple[int, ...], int | None, int]]:
        return _weights(layers or self.layers, self.hidden, self.ffn, self.kv, self.vocab)


LLAMA3_70B = Model("Llama 3 70B", 80, 8192, 28672, 8 * 128, 128256)
LLAMA3_405B = Model("Llama 3 405B", 126, 16384, 53248, 8 * 128, 128256)


@dataclass(frozen=True)
class Layout:
    """Megatron rank order (TP fastest, then DP, then PP); ``fsdp``: every tensor split on
    dim 0 over all ranks (FSDP2), else weights TP-split and replicated over DP, the
    optimizer state flat-partitioned over DP (ZeRO-1)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    fsdp: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, t: int, d: int, s: int) -> int:
        return t + self.tp * (d + self.dp * s)

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank % self.tp, rank // self.tp % self.dp, rank // (self.tp * self.dp)

    def stage_ranks(self, s: int) -> range:
        n = self.tp * self.dp
        return range(s * n, (s + 1) * n)


@dataclass(frozen=True)
class Case:
    name: str
    model: Model
    saved: Layout
    loaded: Layout
    optim: bool = False  # one fp32 Adam state (exp_avg) besides the bf16 weights
    stages: tuple[int, ...] | None = None  # plan only these loaded PP stages (exact for them)
    layers: int | None = None  # plan this many decoder layers, scale figures by bytes

    def ranks(self) -> list[int]:
        """Global ids of the planned ranks."""
        if self.stages is None:
            return list(range(self.loaded.world))
        return [r for s in self.stages for r in self.loaded.stage_ranks(s)]


def _rows(n: int, parts: int, i: int) -> tuple[int, int]:
    step = -(-n // parts)
    return min(n, i * step), min(n, (i + 1) * step)


def _pieces(layout: Layout, shape: tuple[int, ...], dim: int | None, layer: int, layers: int,
            optim: bool) -> Iterable[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, int] | None]]:
    """(rank, box offset, box shape, flat range) of each rank's piece of a tensor, weights
    (flat None) or optimizer state (flat given: ZeRO-1; FSDP states follow the weights)."""
    if layout.fsdp:
        for r in range(layout.world):
            lo, hi = _rows(shape[0], layout.world, r)
            if hi > lo:
                yield r, (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:], None
        return
    s = _stage(layer, layout.pp, layers)
    for t in range(layout.tp if dim is not None else 1):
        off, sh = _tp_box(shape, dim, layout.tp, t)
        if not optim:
            yield layout.rank(t, 0, s), off, sh, None
            continue
        for d in range(layout.dp):
            fl = _flat(math.prod(sh), layout.dp, d)
            if fl[1] > fl[0]:
                yield layout.rank(t, d, s), off, sh, fl


def _kinds(case: Case) -> list[tuple[str, str, int, bool]]:
    """(name prefix, dtype, itemsize, is optimizer state) of the stored kinds."""
    return [("", "BF16", 2, False)] + ([("optim.exp_avg.", "F32", 4, True)] if case.optim else [])


def build_manifest(case: Case):
    """The saved checkpoint: one data file per writer rank, each piece a shard."""
    from streamckpt.core.manifest import Manifest, Shard, TensorMeta

    pos: dict[str, int] = {}
    tensors = {}
    layers = case.layers or case.model.layers
    for name, shape, dim, layer in case.model.weights(case.layers):
        for prefix, dtype, size, opt in _kinds(case):
            shards = []
            for r, off, sh, fl in _pieces(case.saved, shape, dim, layer, layers, opt):
                fname = f"data/{r:05d}.safetensors"
                n = ((fl[1] - fl[0]) if fl else math.prod(sh)) * size
                start = pos.get(fname, 0)
                pos[fname] = start + n
                shards.append(Shard(off, sh, fname, start, n, fl, "raw", CHUNK, (0,) * -(-n // CHUNK)))
            tensors[prefix + name] = TensorMeta(dtype, shape, tuple(shards))
    return Manifest(tensors=tensors, files=dict(pos))


def build_targets(case: Case) -> list[list[Any]]:
    """What each planned rank (``case.ranks()``, in that order) holds in the loaded layout."""
    from streamckpt.core.targets import TargetSpec

    by_rank: dict[int, list[Any]] = {r: [] for r in case.ranks()}
    layers = case.layers or case.model.layers
    for name, shape, dim, layer in case.model.weights(case.layers):
        for prefix, dtype, _, opt in _kinds(case):
            for r, off, sh, fl in _loaded_pieces(case.loaded, shape, dim, layer, layers, opt):
                if r in by_rank:
                    by_rank[r].append(TargetSpec(prefix + name, dtype, shape, off, sh, fl))
    return list(by_rank.values())


def _loaded_pieces(layout: Layout, shape: tuple[int, ...], dim: int | None, layer: int, layers: int,
                   optim: bool) -> Iterable[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, int] | None]]:
    """Like ``_pieces``, but loaded weights are held by every DP replica, not written by one."""
    if layout.fsdp or optim:
        yield from _pieces(layout, shape, dim, layer, layers, optim)
        return
    for r, off, sh, _ in _pieces(layout, shape, dim, layer, layers, False):
        t, _, s = layout.coords(r)
        for d in range(layout.dp):
            yield layout.rank(t, d, s), off, sh, None


# ------------------------------------------------------------------ counting


@dataclass
class Cell:
    """One rank in one round."""

    fetched: int = 0
    requests: int = 0
    local: int = 0  # bytes read from the node's local tier (no GETs)
    sent_intra: int = 0
    sent_inter: int = 0
    recv_intra: int = 0
    recv_inter: int = 0
    staging: int = 0
    peers: set[int] = field(default_factory=set)


@dataclass
class Counts:
    """Per (global rank, round) cells of one strategy's load, and the peers each rank connects to."""

    rounds: int
    cells: dict[tuple[int, int], Cell] = field(default_factory=dict)
    links: dict[int, set[int]] = field(default_factory=dict)  # rank -> every peer over the load
    comms: dict[int, int] = field(default_factory=dict)  # rank -> broadcast communicators (Run:ai)
    # rank -> what a ring all-gather would ask it to send for the same exchanges: each read's (or
    # broadcast's) delivered bytes spread evenly over the ranks taking part (the reader and its
    # receivers): a replicated read of L bytes on h holders asks L × (h - 1) / h of each
    share: dict[int, float] = field(default_factory=dict)

    def cell(self, rank: int, rnd: int) -> Cell:
        got = self.cells.get((rank, rnd))
        if got is None:
            got = self.cells[(rank, rnd)] = Cell()
        return got

    def send(self, src: int, dst: int, rnd: int, n: int, per_node: int) -> None:
        a, b = self.cell(src, rnd), self.cell(dst, rnd)
        if src // per_node == dst // per_node:
            a.sent_intra += n
            b.recv_intra += n
        else:
            a.sent_inter += n
            b.recv_inter += n
        a.peers.add(dst)
        b.peers.add(src)
        self.links.setdefault(src, set()).add(dst)
        self.links.setdefault(dst, set()).add(src)

    def spread(self, ranks: Iterable[int], delivered: int) -> None:
        """Charge ``ranks`` (a read's reader and receivers) an even part of ``delivered`` bytes
        as their all-gather share."""
        ranks = list(ranks)
        for r in ranks:
            self.share[r] = self.share.get(r, 0.0) + delivered / len(ranks)

    def egress_ratio(self) -> float:
        """The busiest rank's egress (bytes sent, within and across nodes) over the largest
        all-gather share (``share``); 0 without exchange."""
        top = max(self.share.values(), default=0.0)
        if not top:
            return 0.0
        sent: dict[int, int] = {}
        for (rank, _), c in self.cells.items():
            sent[rank] = sent.get(rank, 0) + c.sent_intra + c.sent_inter
        return max(sent.values(), default=0) / top


def _lands_whole(r: Any) -> bool:
    """A read the executor fetches straight into host targets (``loading.landing``'s pure
    reads): it feeds no other rank, needs no decoding, and its copies tile it end to end
    (taken to be in the target's dtype: the checked cases load as saved)."""
    if not r.private or r.zstd:
        return False
    pos = 0
    for c in sorted(r.copies, key=lambda c: c.offset):
        if c.offset != pos:
            return False
        pos += c.length
    return pos == r.length


def count_plan(plan: Any, ranks: Sequence[int], per_node: int, concurrency: int = 32,
               piece: int | None = None, host_targets: bool = False, world: int | None = None,
               local_files: Collection[str] = ()) -> Counts:
    """streamckpt: every read of an all-ranks plan, its staging and its messages. GETs as the
    reader makes them: each rank's reads of a round are one batch, cut into requests of
    ``storage.reads.piece_for(batch, piece, concurrency, spread=job_spread(world, concurrency))``
    (``piece``: the client's largest GET, default the S3 clients' ``PIECE``; ``world``: the
    job's ranks, default the planned ones), so a small job's round still spreads over
    connections and a large job's reads stay whole. Reads of ``local_files`` (a local tier's
    copies) count as the reader's node-local bytes, with no GET.
    With ``host_targets`` (a CPU load), reads that land whole in this rank's targets are one
    batch of their own over all rounds, as ``loading.direct`` fetches them."""
    from streamckpt.plan.data import message_size
    from streamckpt.plan.routes import costs_of, hops_of, relay_costs
    from streamckpt.storage.obstore_backend import PIECE
    from streamckpt.loading.requestrate import job_spread
    from streamckpt.storage.reads import piece_for

    spread = job_spread(world or len(ranks), concurrency)
    out = Counts(plan.num_rounds)
    batches: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r in plan.reads:
        reader = ranks[r.reader]
        c = out.cell(reader, r.round)
        if r.file in local_files:
            c.local += r.length
        else:
            c.fetched += r.length
            batches.setdefault((reader, -1 if host_targets and _lands_whole(r) else r.round), []).append(
                (r.round, r.length))
        if r.relay:  # a relayed read spans rounds: each rank's staging in each of them
            for rank, cells in relay_costs(r, plan.targets).items():
                for depth, cost, _ in cells:
                    out.cell(ranks[rank], r.round + depth).staging += cost
        else:
            for rank, cost in costs_of(r, plan.targets).items():
                out.cell(ranks[rank], r.round).staging += cost
        delivered, involved = 0, {reader}
        for depth, src, dst, copies in hops_of(r, plan.targets):
            n = message_size(copies)
            out.send(ranks[src], ranks[dst], r.round + depth, n, per_node)
            delivered += n
            involved.add(ranks[dst])
        if delivered:
            out.spread(involved, delivered)
    for (rank, _), reads in batches.items():  # the direct batch's reads counted in their plan rounds
        step = piece_for(sum(n for _, n in reads), PIECE if piece is None else piece, concurrency,
                         spread=spread)
        for rnd, n in reads:
            out.cell(rank, rnd).requests += _gets(n, step or 0)
    return out


def count_dcp(plan: Any, ranks: Sequence[int], request_bytes: int) -> Counts:
    """DCP: from a ``read_once=False`` plan (every rank reads its own bytes), each rank reads
    every stored item (shard) its reads touch, whole, one item after another; no exchange."""
    out = Counts(1)
    seen: dict[int, dict[tuple[str, int], int]] = {}
    for r in plan.reads:
        mine = seen.setdefault(ranks[r.reader], {})
        for run in r.runs:
            mine[(run.shard.file, run.shard.byte_offset)] = run.shard.byte_length
    for rank, items in seen.items():
        c = out.cell(rank, 0)
        c.fetched = sum(items.values())
        c.requests = sum(_gets(n, request_bytes) for n in items.values())
        c.staging = max(items.values())
    return out


def _gets(n: int, request_bytes: int) -> int:
    return -(-n // request_bytes) if request_bytes else 1


def count_runai(manifest: Any, targets: Sequence[Sequence[Any]], ranks: Sequence[int], per_node: int,
                request_bytes: int) -> Counts:
    """Run:ai: each stored tensor read whole by one rank that needs it (least loaded by bytes),
    then broadcast whole to every rank that needs any part of it. A broadcast is pipelined
    (NCCL ring): a node takes the tensor in over its NIC once and passes it on once, and
    each rank that needs it gets it over NVLink; one communicator per distinct set of ranks."""
    out = Counts(1)
    needers: dict[str, set[int]] = {}
    for i, specs in enumerate(targets):
        for s in specs:
            needers.setdefault(s.key, set()).add(ranks[i])
    load: dict[int, int] = {}
    groups: dict[frozenset[int], None] = {}
    for key in sorted(needers, key=lambda k: (-_tensor_bytes(manifest, k), k)):
        held = needers[key]
        n = _tensor_bytes(manifest, key)
        reader = min(held, key=lambda r: (load.get(r, 0), r))
        load[reader] = load.get(reader, 0) + n
        c = out.cell(reader, 0)
        c.fetched += n
        c.requests += sum(_gets(s.byte_length, request_bytes) for s in manifest.tensors[key].shards)
        _broadcast(out, reader, held, n, per_node)
        out.spread(held | {reader}, n * (len(held) - 1))
        groups[frozenset(held)] = None
    for g in groups:
        for r in g:
            out.comms[r] = out.comms.get(r, 0) + 1
    return out


def _tensor_bytes(manifest: Any, key: str) -> int:
    return sum(s.byte_length for s in manifest.tensors[key].shards)


def _broadcast(out: Counts, reader: int, held: set[int], n: int, per_node: int) -> None:
    """A pipelined ring over nodes, then over each node's ranks: per node n in and n out
    over the NIC (the last node passes nothing on), n into each rank that needs it."""
    nodes = sorted({r // per_node for r in held}, key=lambda x: (x != reader // per_node, x))
    for i, node in enumerate(nodes):
        mine = sorted(r for r in held if r // per_node == node)
        head = reader if node == reader // per_node else mine[0]
        if i > 0:
            out.cell(head, 0).recv_inter += n
        if i + 1 < len(nodes):
            out.cell(head, 0).sent_inter += n
        for r in mine:
            if r != head:
                out.cell(r, 0).recv_intra += n
                out.cell(head, 0).sent_intra += n
        c = out.cell(head, 0)
        c.staging = max(c.staging, n)
        for r in mine:
            out.cell(r, 0).staging = max(out.cell(r, 0).staging, n)


# ------------------------------------------------------------------ time


@dataclass
class Prediction:
    """One strategy on one case: time, bottleneck, and the per-rank figures behind them."""

    strategy: str
    seconds: float
    bottleneck: str
    rounds: int
    fetched_GB: float
    requests: int
    gets_per_s: float
    max_peers_per_round: int
    mean_peers_per_round: float
    max_links: int
    max_inter_sent_GB_per_rank: float
    staging_MiB: float
    nccl_GiB_per_rank: float
    gloo_MiB_per_rank: float
    egress_ratio: float = 0.0  # the busiest rank's egress ÷ an all-gather's per-rank share (``Counts.egress_ratio``)
    terms: dict[str, float] = field(default_factory=dict)


def round_terms(counts: Counts, m: Machine, strategy: str) -> list[dict[str, float]]:
    """Per round, the seconds each resource needs (the slowest rank or node decides)."""
    conc = m.concurrency[strategy]
    per = [dict.fromkeys(("store connections", "first-byte latency", "node store bandwidth",
                          "node local read", "node NIC (exchange)", "NVLink"), 0.0) for _ in range(counts.rounds)]
    node_fetch: dict[tuple[int, int], int] = {}
    node_local: dict[tuple[int, int], int] = {}
    node_out: dict[tuple[int, int], int] = {}
    node_in: dict[tuple[int, int], int] = {}
    for (rank, rnd), c in counts.cells.items():
        t = per[rnd]
        # a connection waits a first byte per GET, then streams: the slowest rank's two parts
        wait, stream = math.ceil(c.requests / conc) * m.first_byte_s, c.fetched / (conc * m.conn_Bps)
        if wait + stream > t["first-byte latency"] + t["store connections"]:
            t["first-byte latency"], t["store connections"] = wait, stream
        t["NVLink"] = max(t["NVLink"], max(c.sent_intra, c.recv_intra) / m.nvlink_Bps)
        key = (rank // m.gpus_per_node, rnd)
        node_fetch[key] = node_fetch.get(key, 0) + c.fetched
        node_local[key] = node_local.get(key, 0) + c.local
        node_out[key] = node_out.get(key, 0) + c.sent_inter
        node_in[key] = node_in.get(key, 0) + c.recv_inter
    for (node, rnd), n in node_fetch.items():
        t = per[rnd]
        t["node store bandwidth"] = max(t["node store bandwidth"], n / m.node_store_Bps)
        if node_local[(node, rnd)]:
            t["node local read"] = max(t["node local read"], node_local[(node, rnd)] / m.local_Bps)
        t["node NIC (exchange)"] = max(t["node NIC (exchange)"],
                                       max(node_out[(node, rnd)], node_in[(node, rnd)]) / m.nic_Bps)
    return per


FETCH = ("store connections", "first-byte latency", "node store bandwidth", "node local read")


def pipeline_seconds(per: list[dict[str, float]], overlap: bool) -> tuple[float, dict[str, float]]:
    """Round k+1's fetch overlaps round k's exchange (streamckpt's pipeline); ``overlap`` False
    for one-round strategies, where fetch and exchange stream together (max of the two).
    Returns the time and the seconds on the critical path charged to each resource."""
    charged: dict[str, float] = {}

    def fetch(t: dict[str, float]) -> tuple[str, float]:
        """A round's GETs start together once its arena is free: they wait their first bytes,
        then stream at what the rank's connections or its node's store link allow. The link
        idles during the wait (the previous round's fetch is done; its exchange uses the
        fabric), so the first byte adds to the node's time too (checked in docs/SCALE.md,
        "Checked against measurement": it had been hidden behind the node's bandwidth)."""
        k = max(FETCH, key=lambda x: t[x])
        return k, t["first-byte latency"] + max(t["store connections"], t["node store bandwidth"],
                                                t["node local read"])

    def xch(t: dict[str, float]) -> tuple[str, float]:
        k = max(("node NIC (exchange)", "NVLink"), key=lambda x: t[x])
        return k, t[k]

    def charge(k: str, s: float) -> float:
        charged[k] = charged.get(k, 0.0) + s
        return s

    if not overlap:
        return sum(charge(*max(fetch(t), xch(t), key=lambda x: x[1])) for t in per), charged
    total = charge(*fetch(per[0])) if per else 0.0
    for k in range(len(per)):
        nxt = fetch(per[k + 1]) if k + 1 < len(per) else ("", 0.0)
        total += charge(*max(nxt, xch(per[k]), key=lambda x: x[1]))
    charged.pop("", None)
    return total, charged


def predict(counts: Counts, m: Machine, strategy: str, scale: float = 1.0, world: int | None = None) -> Prediction:
    """Time and bottleneck; ``scale`` multiplies bytes, requests and time (coarsened cases),
    ``world`` the job's ranks when ``counts`` holds only part of them (GET rate scales)."""
    per = round_terms(counts, m, strategy)
    seconds, charged = pipeline_seconds(per, overlap=strategy == "streamckpt")
    seconds *= scale
    cells = counts.cells.values()
    planned = len({r for r, _ in counts.cells}) or 1
    job = (world or planned) / planned
    requests = round(sum(c.requests for c in cells) * scale * job)
    prefix_floor = requests / m.prefix_gets
    bottleneck = max(charged, key=charged.__getitem__) if charged else "none"
    if prefix_floor > seconds:
        seconds, bottleneck = prefix_floor, "S3 prefix GET rate"
    peers = [len(c.peers) for c in cells]
    links = max((len(v) for v in counts.links.values()), default=0)
    comm_peers = max((2 * n for n in counts.comms.values()), default=0)
    conn = max(links, comm_peers)
    return Prediction(
        strategy, seconds, bottleneck, counts.rounds,
        fetched_GB=sum(c.fetched for c in cells) * scale * job / GB, requests=requests,
        gets_per_s=requests / seconds if seconds else 0.0,
        max_peers_per_round=max(peers, default=0), mean_peers_per_round=sum(peers) / max(1, len(peers)),
        max_links=conn, max_inter_sent_GB_per_rank=_max_total(counts, "sent_inter") * scale / GB,
        staging_MiB=max((c.staging for c in cells), default=0) / MiB,
        nccl_GiB_per_rank=conn * m.nccl_peer_bytes / 2**30, gloo_MiB_per_rank=conn * m.gloo_peer_bytes / MiB,
        egress_ratio=counts.egress_ratio(),
        terms={k: round(v * scale, 2) for k, v in charged.items()})


def _max_total(counts: Counts, what: str) -> int:
    tot: dict[int, int] = {}
    for (rank, _), c in counts.cells.items():
        tot[rank] = tot.get(rank, 0) + getattr(c, what)
    return max(tot.values(), default=0)


# ------------------------------------------------------------------ cases


def plan_counts(manifest: Any, targets: Sequence[Sequence[Any]], ranks: Sequence[int],
                m: Machine, world: int | None = None) -> dict[str, Counts]:
    """The three strategies' counts on one job (the planner's default options, and its nodes as
    torchrun's ``LOCAL_WORLD_SIZE`` gives them to a load: the planned ranks are whole nodes, in order).
    ``world``: the whole job's ranks (default the planned ones), which sets how finely each rank
    cuts its reads (``loading.requestrate.job_spread``)."""
    from streamckpt.plan.planner import PlanOptions, build_plan

    plan = build_plan(manifest, targets, PlanOptions(ranks_per_node=m.gpus_per_node))
    own = build_plan(manifest, targets, PlanOptions(read_once=False))
    return {
        "streamckpt": count_plan(plan, ranks, m.gpus_per_node, m.concurrency["streamckpt"],
                                 m.request_bytes["streamckpt"], world=world or len(ranks)),
        "dcp": count_dcp(own, ranks, m.request_bytes["dcp"]),
        "runai": count_runai(manifest, targets, ranks, m.gpus_per_node, m.request_bytes["runai"]),
    }


def predict_load(manifest: Any, targets: Sequence[Sequence[Any]], m: Machine, *,
                 read_once: bool = True) -> Prediction:
    """streamckpt's load of ``manifest`` into ``targets`` (one list per rank, rank ``i`` on
    node ``i // m.gpus_per_node``), planned as ``sc.load`` plans it by default: for checking
    the model against a measured load (benchmarks/scale_check.py)."""
    from streamckpt.plan.planner import PlanOptions, build_plan

    plan = build_plan(manifest, targets, PlanOptions(read_once=read_once))
    return predict(count_plan(plan, range(len(targets)), m.gpus_per_node, m.concurrency["streamckpt"],
                              m.request_bytes["streamckpt"], host_targets=True), m, "streamckpt")


def coarsening(case: Case) -> float:
    """Stored bytes of the whole model over those of the planned one (1 when all layers are planned)."""
    if case.layers is None:
        return 1.0
    full = build_manifest(replace(case, layers=None))
    part = build_manifest(case)
    return sum(full.files.values()) / sum(part.files.values())


def run_case(case: Case, m: Machine) -> list[Prediction]:
    ranks = case.ranks()
    counts = plan_counts(build_manifest(case), build_targets(case), ranks, m, case.loaded.world)
    scale = coarsening(case)
    return [predict(counts[s], m, s, scale, case.loaded.world) for s in STRATEGIES]


CASES = {
    "70b-resume": Case("70B, TP8×PP4×DP8 (256) → TP8×PP8×DP16 (1024), weights + exp_avg",
                       LLAMA3_70B, Layout(8, 4, 8), Layout(8, 8, 16), optim=True, stages=(0, 4, 7)),
    "405b-scale": Case("405B, TP8×PP16×DP16 (2048) → TP8×PP16×DP128 (16384), weights",
                       LLAMA3_405B, Layout(8, 16, 16), Layout(8, 16, 128), stages=(0, 8, 15)),
    "70b-serve": Case("70B, TP8 → 512 TP8 replicas (4096), weights",
                      LLAMA3_70B, Layout(8, 1, 1), Layout(8, 1, 512), layers=4),
    "70b-serve-1024": Case("70B, TP8 → 128 TP8 replicas (1024, 128 nodes), weights",
                           LLAMA3_70B, Layout(8, 1, 1), Layout(8, 1, 128)),
    "70b-fsdp": Case("70B, FSDP 512 → 1024, weights + exp_avg",
                     LLAMA3_70B, Layout(1, 1, 512, fsdp=True), Layout(1, 1, 1024, fsdp=True), optim=True, layers=8),
}


def table(rows: list[tuple[str, Prediction]]) -> str:
    head = ("| case | strategy | predicted s | bottleneck | rounds | fetched GB (job) | GETs (job) | GET/s "
            "| peers/rank/round max (mean) | peers over the load (max) | inter-node sent GB (max rank) "
            "| staging MiB (max) | NCCL GiB/rank | busiest egress ÷ all-gather share |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, p in rows:
        lines.append(f"| {name} | {p.strategy} | {p.seconds:.1f} | {p.bottleneck} | {p.rounds} | "
                     f"{p.fetched_GB:.0f} | {p.requests} | {p.gets_per_s:.0f} | "
                     f"{p.max_peers_per_round} ({p.mean_peers_per_round:.1f}) | {p.max_links} | "
                     f"{p.max_inter_sent_GB_per_rank:.2f} | {p.staging_MiB:.0f} | {p.nccl_GiB_per_rank:.2f} | "
                     f"{p.egress_ratio:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json
    import time

    ap = argparse.ArgumentParser(description="Predict loads at scale from real plans.")
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--machine", default="configs/scale/aws_p5.yaml")
    ap.add_argument("--json", action="store_true", help="one JSON line per prediction too")
    args = ap.parse_args(argv)
    m = load_machine(args.machine)
    rows = []
    for key in args.cases:
        t0 = time.perf_counter()
        preds = run_case(CASES[key], m)
        print(f"# {key}: {CASES[key].name} (planned in {time.perf_counter() - t0:.0f} s)", flush=True)
        for p in preds:
            rows.append((key, p))
            if args.json:
                print(json.dumps({"case": key, **p.__dict__}), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
