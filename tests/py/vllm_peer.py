"""A peer speaking vLLM 0.33's NixlConnector side-channel protocol with vLLM's own wire
libraries (pyzmq, msgspec), written from the wire format, driven line by line over stdin.

Used by tests/vllm_protocol.rs, tests/vllm_multi_turn.rs, tests/vllm_pipeline.rs,
tests/vllm_dcp.rs and tests/vllm_push.rs (push mode, NixlPushConnector's wire). Each command line gets one answer line starting "@@ ". Arguments are hex
where they could hold spaces.

  serve HASH RANKS EXTRA BIG   a ROUTER answering get_meta_msg as vLLM's listener does,
                               for RANKS ("0:0,0:1"), under HASH ("-" for empty); EXTRA 1
                               adds unknown keys to the payload and the metadata; BIG > 0
                               makes agent_metadata BIG bytes -> the port
  fetch PORT PP TP HASH ENFORCE  a REQ handshake as vLLM's decode runs it -> JSON
  raw PORT HEX                 a REQ sends HEX as the request -> JSON of the reply frames
  idle PORT N                  N REQ sockets connect and never send -> ok
  hash HEXJSON                 vLLM's compatibility hash of the factors -> JSON
  notify_done HEXID N          vLLM's done notification -> HEX
  notify_hb HEXIDS             vLLM's heartbeat of the comma-joined hex ids -> HEX
  parse_notif HEX              vLLM's reading of a notification -> JSON

A prefill and a decode with NIXL's Python agent (DRAM, UCX), as vLLM's run them:
  kv_prefill HASH EXTRA LIE ENGINE REGIONS BLOCKS BLOCK_LEN BLOCK_SIZE [REGION_GROUPS [PPL [SSM]]]
                               an agent registering REGIONS buffers of BLOCKS blocks of
                               BLOCK_LEN bytes (byte i of region r: kv_byte(r, i)) and a
                               ROUTER serving rank (0, 0)'s NixlAgentMetadata under HASH;
                               EXTRA 1 adds unknown keys; LIE 1 claims base addresses 1 MiB
                               past the buffers; REGION_GROUPS ("-1,-1"; "-" or absent:
                               every region group 0's) is each region's KV cache group, -1
                               for one that several groups share; PPL (default 1) kernel
                               blocks per logical block (vLLM's
                               physical_blocks_per_logical_kv_block: BLOCKS and BLOCK_SIZE
                               are the kernel's, block ids logical); SSM ("24,8,8/64") the
                               conv sub-projections' and temporal state's bytes of a Mamba
                               layer's page in every region, published as ssm_sizes
                               -> JSON {port, agent}
  kv_finish HEXREQ BLOCKS [WINDOW [TOKENS]]
                               vLLM's request_finished params for the prefill's (logical)
                               blocks BLOCKS of request HEXREQ: one group ("3,4"), or one
                               list per group ("3,4;7,8,9"), the last a sliding window of
                               WINDOW tokens (0: none) clipped to the blocks it needs, or,
                               for WINDOW "ssm:N", a Mamba group of N speculative blocks
                               clipped to its state-bearing block; TOKENS the prompt's
                               (default: every token of the first list's blocks); they
                               carry the prefill's registration generation -> JSON
  kv_keep HEXREQ BLOCKS TOKENS TTL
                               the kv_prefill engine as vLLM's decode with
                               bidirectional_kv_xfer finishing request HEXREQ of (logical)
                               blocks BLOCKS ("6,7,8") after TOKENS computed tokens:
                               request_finished's params with is_d_node (do_remote_decode,
                               remote_num_tokens, and remote_blocks_expiry_time TTL seconds
                               ahead on its perf_counter) -> JSON
  kv_pull HEXPARAMS HASH LOCAL [PROMPT COMPUTED THRESHOLD]
                               the kv_prefill engine reads, into its own blocks LOCAL ("-":
                               none), the request of the JSON kv_transfer_params HEXPARAMS
                               (one group) as vLLM's pull worker: a handshake (hash checked)
                               once per engine, its clock offset kept, then a READ of the
                               remote blocks' suffix with the notification "REQ:1", or the
                               notification alone for no blocks. With PROMPT etc., a turn-2
                               read-back of a decode's kept blocks: the tokens counted as
                               get_num_new_matched_tokens does (PROMPT tokens, COMPUTED of
                               them prefix-cached, THRESHOLD its kv_recompute_threshold),
                               LOCAL cut to the blocks they need, and the read declined when
                               the expiry time is within vLLM's 5 s margin -> JSON {tokens,
                               clock_offset, left, remote_blocks, data: HEX of LOCAL region
                               by region}, or with declined, notified or error
  kv_reregister                the prefill registers its KV cache again, as vLLM's sleep mode
                               (unregister_kv_caches, restore_kv_caches, then the engine
                               core's _set_kv_connector_handshake_metadata): its memory
                               deregistered (the old buffers kept, unregistered), new
                               buffers registered (byte i of region r: kv_byte(r, i, SALT),
                               SALT the registrations before it), the changed payload served,
                               a new registration generation -> JSON {generation, salt}
  kv_served                    how many get_meta_msg requests the prefill's ROUTER answered
  kv_notifs N SECONDS          the prefill agent's next N notifications, waiting at most
                               SECONDS -> JSON [{from, hex, vllm}] in arrival order
  kv_decode PORT HASH ENFORCE ENGINE BLOCKS HEXREQ CONSUMERS [SSM]
                               a decode: get_meta_msg for rank (0, 0), the hash checked
                               before the metadata is decoded into vLLM's layout, the
                               remote agent added, BLOCKS READ from every region into a
                               registered buffer with the notification "REQ:CONSUMERS";
                               with SSM ("24,8,8/64:21"), then a Mamba state block (21)
                               read as vLLM's decode reads it: in every region each conv
                               sub-projection, then the temporal state after the conv
                               state, each a descriptor of its own, after the attention
                               ones; refused unless the metadata's ssm_sizes are these
                               -> JSON {data: HEX of the buffer, agent, meta} or the refusal
  kv_load HEXPARAMS HASH CONSUMERS
                               vLLM's pull decode (one agent for its life) reading the request
                               of the prefill's JSON kv_transfer_params HEXPARAMS (one group;
                               the prefill on loopback): its stored registration generation
                               of the engine below the params' drops the engine's remote
                               agent, a handshake (as kv_decode's) only for an engine it has
                               not loaded, then the READ with kv_decode's notification
                               -> JSON {data, handshaken, generation} or the refusal
  kv_heartbeat PORT HASH ENFORCE ENGINE COUNT PREFIX
                               a decode (handshake as kv_decode's) waiting for COUNT requests:
                               one vLLM heartbeat naming PREFIX-0 ... PREFIX-(COUNT-1), each
                               left-padded with 'x' to 48 characters -> JSON {bytes}

Push mode (vLLM 0.33's NixlPushConnector), the kv_prefill engine as its prefill:
  kv_push_finish HEXREQ BLOCKS [TOKENS]
                               vLLM's push request_finished for request HEXREQ of (one
                               group's, logical) blocks BLOCKS: they wait for a decode's
                               registration -> JSON params (transfer_mode "push", no
                               remote_blocks_expiry_time or remote_registration_generation)
  kv_push_write HASH SECONDS DELAY
                               vLLM's push writer: the first PUSH_REG registration whose
                               request id (exact, else without vLLM's "-" + 8 hex suffix)
                               is a finished request's, waited for at most SECONDS, held
                               DELAY seconds, then a handshake with its decode (hash HASH
                               checked), the finished blocks cut to the last as many as it
                               registered, and one WRITE of every region into its blocks
                               notifying "{its request id}:1"; other notifications go to
                               kv_notifs -> JSON {registration, hex, from, matched, written,
                               into, agent}, or with mismatch or error

The kv_prefill engine as vLLM's push decode (its ROUTER serves the prefill's handshake):
  kv_push_register HEXPARAMS HASH HEXREQ LOCAL HOST
                               a handshake (hash HASH checked) with the prefill of the JSON
                               kv_transfer_params HEXPARAMS, once per engine (and with each
                               of its other TP ranks), then one PUSH_REG notification to each
                               rank: vLLM's eleven keys for its own request HEXREQ, its
                               blocks LOCAL ("0,1,2", one group), its side channel named
                               HOST -> JSON {hex, agent, agents} or the refusal
  kv_push_hb ENGINE HEXIDS     vLLM's heartbeat to ENGINE's agent naming the comma-joined ids
  kv_push_wait HEXREQ LOCAL SECONDS [COUNT]
                               COUNT (default 1) notifications naming request HEXREQ (the
                               prefill ranks' WRITEs), waited for at most SECONDS -> JSON
                               {from, senders, hex, vllm, data: HEX of its blocks LOCAL,
                               region by region} or an error

A third agent:
  kv_forge PORT HASH ENGINE HEXMSG
                               a fresh agent handshakes with ENGINE's ROUTER at PORT (hash
                               HASH checked) and sends it the notification HEXMSG -> JSON

Decode context parallelism (DCP, vLLM 0.33's NixlConnector with an MLA cache): an engine of
DCP = TP ranks, rank r holding the request's global block positions r, r + DCP, ..., the
j-th block of the request's list (the same on every rank) holding position j * DCP + r.
  kv_dcp_prefill HASH ENGINE DCP REGIONS BLOCKS BLOCK_LEN BLOCK_SIZE [PCP]
                               DCP agents, rank r registering REGIONS buffers of BLOCKS
                               blocks (byte i of region g: kv_byte(g, i, SALT=r)), and one
                               ROUTER serving rank (0, r)'s NixlAgentMetadata with dcp_size
                               DCP and pcp_size PCP (default 1): with PCP = DCP, vLLM's
                               PCP+DCP prefill (its transfer ranks are its PCP ranks); with
                               DCP 1, rank 0 of a replicated PCP prefill -> JSON {port, agents}
  kv_dcp_notifs N SECONDS      the DCP prefill's next N notifications to any rank, waiting at
                               most SECONDS -> JSON [{rank, from, vllm}] in arrival order
  kv_dcp_decode HEXPARAMS HASH DCP RANK CONSUMERS
                               one rank (RANK of DCP) of a decode reading the request of the
                               JSON kv_transfer_params HEXPARAMS from a prefill of its tp_size
                               and dcp_size: a handshake with each remote rank whose positions
                               may meet its own (its metadata's pcp_size and dcp_size
                               checked as vLLM's decode checks them, refused with its reason,
                               and its dcp_size against the params'), one READ of every region of the blocks of the
                               positions both hold with the notification "REQ:CONSUMERS", or
                               that notification alone when they hold none in common
                               -> JSON {positions: {g: HEX of every region's block}, read:
                               {remote rank: blocks}, notified_only: [remote ranks]}, or
                               {refused: vLLM's reason}

Pipeline parallelism (vLLM 0.33's NixlConnector, pull mode): an engine of PP stages of TP
ranks, stage s holding vLLM's even split of the model's layers (each stage layers // PP, the
rest one each to the stages before the last, from the second-to-last back).
  kv_pp_prefill HASH ENGINE PP TP LAYERS BLOCKS BLOCK_LEN BLOCK_SIZE
                               PP x TP agents, rank (s, t) registering a buffer of BLOCKS
                               blocks for each layer g of stage s (byte i: kv_byte(g, i,
                               SALT=t)), and one ROUTER serving rank (s, t)'s
                               NixlAgentMetadata for get_meta_msg (s, t) -> JSON {port,
                               stages: [[first layer, layers]], agents: {"s:t": name}}
  kv_pp_finish HEXREQ BLOCKS   vLLM's pull request_finished params of the PP prefill for its
                               request HEXREQ of BLOCKS ("3,9,14"), saying its pp_size
                               -> JSON
  kv_pp_notifs N SECONDS       the PP prefill's next N notifications to any rank (heartbeats
                               skipped), waiting at most SECONDS, each counted as vLLM's
                               prefill worker counts them: a rank frees a request once as many
                               notified as the notification says, the engine once every rank
                               freed it (vLLM's scheduler waits for every worker) -> JSON
                               {notes: [{rank: "s:t", from, vllm}], freed: {"s:t": [ids]},
                               engine_freed: [ids]}
  kv_pp_push_finish HEXREQ BLOCKS
                               vLLM's push request_finished of the PP prefill for request
                               HEXREQ of BLOCKS: every rank holds them -> JSON params
                               (transfer_mode "push", no expiry time)
  kv_pp_push_write HASH SECONDS
                               every rank of the PP prefill as vLLM's push writer for the
                               first registration its agent gets that names a held request
                               (exact or base id): a handshake with the decode rank it writes
                               (HASH checked), its stage's layers' blocks cut to the decode's
                               WRITTEN at its heads' slice of the decode's blocks, notified
                               "REQ:TP" -> JSON {ranks: {"s:t": {written, into, agent,
                               slot}}} or why not
  kv_hma_pp_prefill HASH ENGINE PP LAYERS BLOCKS BLOCK_LEN BLOCK_SIZE
                               a push prefill of PP stages (TP 1) of a hybrid model (full
                               attention at the even layers, a sliding window at the odd),
                               each stage's tensors laid out from its own layers as vLLM lays
                               them and named in region_members -> JSON {port, regions}
  kv_hma_pp_push_finish HEXREQ FULL;WINDOW
                               its push request_finished for request HEXREQ of each group's
                               blocks ("3,9,14;1,6,2") -> JSON params
  kv_hma_pp_push_write HASH SECONDS
                               every stage as vLLM's push writer: its regions aligned with
                               the decode's by layer name (_align_remote_regions_by_layer),
                               each layer WRITTEN with its group's blocks, notified "REQ:1"
                               -> JSON {ranks: {"s:0": {layers, descs}}} or why not
  kv_hma_decode HASH ENGINE LAYERS BLOCKS BLOCK_LEN BLOCK_SIZE
                               a push decode (TP 1) of that hybrid model, its tensors named
                               in region_members (zero) -> JSON {port, regions}
  kv_hma_push_register HEXPARAMS HASH HEXREQ FULL;WINDOW
                               its handshake with every (pp_rank, tp_rank) of the prefill and
                               a PUSH_REG of its blocks per group to each -> JSON {stages}
  kv_hma_push_wait HEXREQ COUNT SECONDS
                               COUNT notifications "REQ:N" waited for, then every region's
                               bytes -> JSON {vllm, senders, data: HEX} or why not
  kv_pp_decode PORT HASH ENGINE LAYERS PP STAGE BLOCKS HEXREQ CONSUMERS
                               one stage's part of a decode of one stage (TP 1) reading a
                               prefill of PP stages of LAYERS layers (not vLLM 0.33's pull
                               decode, which reads pp_rank 0 alone): get_meta_msg for
                               rank (STAGE, 0) (hash checked as kv_decode's), its regions
                               counted against vLLM's split, BLOCKS READ from each with the
                               notification "REQ:CONSUMERS", one agent for every stage
                               -> JSON {first_layer, layers, agent, data: HEX} or the refusal
  quit
"""

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

GET_META_MSG = b"get_meta_msg"
# vLLM's margin (seconds) before a decode's kept blocks expire within which a turn-2
# read-back is declined.
EXPIRY_SAFETY_MARGIN = 5.0
NIXL_CONNECTOR_VERSION = 15


# vLLM's field layout, from the wire format: names, order, types and defaults.
@dataclass
class NixlAgentMetadata:
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class NixlHandshakePayload:
    compatibility_hash: str
    agent_metadata_bytes: bytes


ctx = zmq.Context()
idle_sockets = []
# The kv_prefill agent, its buffers, its port and what it was asked to serve.
kv = {}
decodes = [0]
# The kv_heartbeat agents: kept, so that their notifications are not cut short.
heartbeat_agents = []
# The kv_load decode: its agent, the remote engines it loaded (engine id -> (remote agent
# name, metadata)) and the registration generation it stored for each.
puller = {"agent": None, "engines": {}, "generations": {}}
# The DCP prefill: its ranks' agents, buffers and registrations, and notifications taken.
dcp_prefill = {"ranks": [], "notifs": []}
# The PP prefill: its ranks ((s, t) -> agent, buffers, registration), the notifications
# received and not yet taken, each rank's count and expected count per request, and the
# requests each rank freed.
pp_prefill = {"ranks": {}, "pending": [], "counts": {}, "freed": {}}
# The kv_pp_decode decode rank's agent.
pp_decoder = {"agent": None}
# The hybrid PP prefill: its ranks ((s, 0) -> agent, buffers, registration, regions as
# hma_regions gives them) and its requests held for a push registration (id -> groups).
hma_pp = {"ranks": {}, "push": {}}
# The hybrid push decode: its agent, buffers, registration, port, engine id and the
# notifications it took that no wait asked for.
hma_decode = {}


def answer(value):
    print("@@", value, flush=True)


def metadata(rank, big):
    return NixlAgentMetadata(
        engine_id="py-prefill",
        agent_metadata=(b"\x5a" * big) if big else f"py-agent-md-{rank}".encode(),
        kv_caches_base_addr=[0x7F0000000000 + rank * 0x1000, 0xFFFFFFFFFFFFFFFF],
        device_id=rank,
        num_blocks=32,
        block_lens=[4096, 4096],
        block_strides=[4096, 8192],
        kv_cache_layout="HND",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[32, 32],
        region_group_ids=[0, 1],
        region_names=["model.layers.0", "model.layers.1"],
        region_mem_types=["VRAM", "VRAM"],
        dcp_size=1,
        pcp_size=1,
        ple_block_len=None,
        region_members=[["model.layers.0.attn"], ["model.layers.1.attn", "x"]],
        packed_member_layouts={"model.layers.0.attn": (0, 2048)},
    )


def encode_payload(hash_, meta, extra):
    if not extra:
        md = msgspec.msgpack.encode(meta)
        return msgspec.msgpack.encode(NixlHandshakePayload(hash_, md))
    # A newer peer: keys this layout does not know, after the known ones.
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    fields["kv_from_the_future"] = [[1, 2], {"a": b"b"}]
    md = msgspec.msgpack.encode(fields)
    return msgspec.msgpack.encode(
        {"compatibility_hash": hash_, "agent_metadata_bytes": md, "also_new": 7}
    )


def dram_metadata(engine, agent, addrs, blocks, block_len, block_size, first_layer=0, **more):
    """A rank's metadata as a vLLM worker describes host KV caches: one region per layer at
    `addrs` (layers from `first_layer` on), `blocks` blocks of `block_len` bytes each, one
    KV cache group; `more` sets other fields."""
    count = len(addrs)
    fields = dict(
        engine_id=engine,
        agent_metadata=agent.get_agent_metadata(),
        kv_caches_base_addr=list(addrs),
        device_id=0,
        num_blocks=blocks,
        block_lens=[block_len] * count,
        block_strides=[block_len] * count,
        kv_cache_layout="LBHNC",
        block_size=block_size,
        ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[blocks] * count,
        region_group_ids=[0] * count,
        region_names=[f"model.layers.{first_layer + g}.self_attn.attn" for g in range(count)],
        region_mem_types=["DRAM"] * count,
    )
    fields.update(more)
    return NixlAgentMetadata(**fields)


def serve_ranks(payloads):
    """A ROUTER on a random port answering GET_META for each (pp rank, tp rank) of
    `payloads` in a thread; its port."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def loop():
        while True:
            identity, _, msg = sock.recv_multipart()
            tag, pp, tp = msgspec.msgpack.decode(msg)
            assert tag == GET_META_MSG and (pp, tp) in payloads, (tag, pp, tp)
            ts = msgspec.msgpack.encode(time.perf_counter())
            sock.send_multipart((identity, b"", payloads[(pp, tp)], ts))

    threading.Thread(target=loop, daemon=True).start()
    return port


def serve(hash_, ranks, extra, big):
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    data = {}
    for item in ranks.split(","):
        pp, tp = (int(x) for x in item.split(":"))
        data[(pp, tp)] = encode_payload(hash_, metadata(tp, big), extra)

    def loop():
        while True:
            identity, _, msg = sock.recv_multipart()
            tag, pp, tp = msgspec.msgpack.decode(msg)
            assert tag == GET_META_MSG, tag
            ts = msgspec.msgpack.encode(time.perf_counter())
            sock.send_multipart((identity, b"", data[(pp, tp)], ts))

    threading.Thread(target=loop, daemon=True).start()
    return port


def req(port, timeout_ms):
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def fetch(port, pp, tp, local_hash, enforce):
    sock = req(port, 5000)
    try:
        start = time.perf_counter()
        sock.send(msgspec.msgpack.encode((GET_META_MSG, pp, tp)))
        parts = sock.recv_multipart()
        rtt = time.perf_counter() - start
    except zmq.Again:
        return {"error": "timeout"}
    finally:
        sock.close()
    if len(parts) != 2:
        return {"error": f"{len(parts)} reply frames"}
    remote_perf = msgspec.msgpack.decode(parts[1])
    try:
        payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return {"error": f"payload: {e}", "raw": msgspec.msgpack.decode(parts[0])}
    if enforce and payload.compatibility_hash != local_hash:
        return {"mismatch": [local_hash, payload.compatibility_hash]}
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    out = {}
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        out[f.name] = value.hex() if isinstance(value, bytes) else value
    return {
        "meta": out,
        "ssm_sizes_is_tuple": isinstance(meta.ssm_sizes, tuple),
        # msgspec's own encoding of what it decoded, byte for byte against ours.
        "same_bytes": msgspec.msgpack.encode(meta) == payload.agent_metadata_bytes,
        "payload_same_bytes": msgspec.msgpack.encode(payload) == parts[0],
        "remote_perf": remote_perf,
        "rtt": rtt,
    }


def raw(port, request):
    sock = req(port, 2000)
    try:
        sock.send(request)
        parts = sock.recv_multipart()
    except zmq.Again:
        return {"error": "timeout"}
    finally:
        sock.close()
    frames = []
    for part in parts:
        try:
            frames.append(msgspec.msgpack.decode(part))
        except msgspec.DecodeError:
            frames.append(part.hex())
    try:
        msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
        vllm = "decoded"
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        vllm = str(e)
    return {"frames": [repr(f) if isinstance(f, bytes) else f for f in frames], "vllm": vllm}


def compat_hash(f):
    spec = f.get("speculative_config")
    if spec is not None:
        ids = spec.get("auxiliary_layer_ids")
        spec = {
            "method": spec["method"],
            "model": spec["model"],
            "revision": spec.get("revision"),
            "code_revision": spec.get("code_revision"),
            "parallel_drafting": spec["parallel_drafting"],
            "kv_cache_dtype": spec["kv_cache_dtype"],
            "auxiliary_layer_ids": tuple(ids) if ids is not None else None,
        }
    factors = {
        "vllm_version": f["vllm_version"],
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": f["model"],
        "dtype": f["dtype"],
        "num_kv_heads": f["num_kv_heads"],
        "head_size": f["head_size"],
        "num_hidden_layers": f["num_hidden_layers"],
        "attn_backend_name": f["attn_backend_name"],
        "cache_dtype": f["cache_dtype"],
        "is_hma_enabled": f["is_hma_enabled"],
        "speculative_config": spec,
        "transfer_mode": f.get("transfer_mode", "pull"),
    }
    text = json.dumps(factors, sort_keys=True)
    return {"json": text, "hash": hashlib.sha256(text.encode()).hexdigest()}


def parse_notif(notif):
    msg = notif.decode("utf-8")
    if msg.startswith("HB:"):
        return {"hb": msg[3:].split(",")}
    req_id, consumers = msg.rsplit(":", 1)
    return {"id": req_id, "consumers": int(consumers)}


def kv_byte(region, size, salt=0):
    """The bytes a kv_prefill region holds: different in every block, region and byte, and
    in every registration (SALT, the registrations before it)."""
    i = np.arange(size, dtype=np.uint64)
    return ((i * 7 + (i >> 8) * 13 + region * 131 + salt * 89 + 3) % 256).astype(np.uint8)


def parse_ssm(arg):
    """"24,8,8/64" -> ([24, 8, 8], 64): a Mamba page's conv sub-projections and temporal
    state, in bytes, per rank."""
    conv, temporal = arg.split("/")
    return [int(x) for x in conv.split(",")], int(temporal)


def ssm_parts(conv, temporal):
    """The (offset, bytes) of each part of a Mamba page as vLLM's DS conv layout has them:
    the conv sub-projections one after the other, then the temporal state."""
    parts, offset = [], 0
    for size in conv:
        parts.append((offset, size))
        offset += size
    return parts + [(sum(conv), temporal)]


def publish(payload):
    """vLLM's set_xfer_handshake_metadata for rank (0, 0): a payload that differs from the
    one served starts a new registration generation."""
    if kv.get("payload") != payload:
        kv["generation"] = kv.get("generation", 0) + 1
    kv["payload"] = payload


def kv_prefill(hash_, extra, lie, engine, regions, blocks, block_len, block_size, region_groups,
               ppl, ssm):
    from nixl_cu12 import nixl_agent

    name = f"py-prefill-{os.getpid()}"
    agent = nixl_agent(name)
    bufs, reg = register_kv(agent, regions, blocks * block_len, 0)
    addrs = [b.ctypes.data for b in bufs]
    shift = (1 << 20) if lie else 0
    meta = dram_metadata(
        engine, agent, [a + shift for a in addrs], blocks, block_len, block_size,
        ssm_sizes=(sum(ssm[0]), ssm[1]) if ssm else (0, 0),
        physical_blocks_per_logical_kv_block=ppl,
        # A tensor that layers of several groups share is marked -1.
        region_group_ids=region_groups or [0] * regions,
    )
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    # A new engine's scheduler: nothing served yet, generation 0 until the first payload.
    kv.update(payload=None, generation=0)
    publish(encode_payload(hash_, meta, extra))

    def loop():
        while True:
            identity, _, msg = sock.recv_multipart()
            tag, pp, tp = msgspec.msgpack.decode(msg)
            assert tag == GET_META_MSG and (pp, tp) == (0, 0), (tag, pp, tp)
            ts = msgspec.msgpack.encode(time.perf_counter())
            kv["served"] += 1
            # The payload served now: a re-registration replaces it.
            sock.send_multipart((identity, b"", kv["payload"], ts))

    # vLLM's scheduler works in logical blocks of the kernel's PPL blocks.
    kv.update(agent=agent, bufs=bufs, reg=reg, port=port, engine=engine,
              block_size=block_size * ppl, notifs=[], meta=meta, hash=hash_, extra=extra,
              shift=shift, salt=0, retired=[], served=0)
    threading.Thread(target=loop, daemon=True).start()
    return {"port": port, "agent": name}


def register_kv(agent, regions, size, salt):
    """REGIONS buffers of SIZE bytes of kv_byte(r, i, SALT), registered with AGENT."""
    bufs = [kv_byte(r, size, salt) for r in range(regions)]
    reg = agent.get_reg_descs([(b.ctypes.data, size, 0, "") for b in bufs], "DRAM")
    agent.register_memory(reg)
    return bufs, reg


def kv_reregister():
    # vLLM's sleep mode on the prefill: unregister_kv_caches deregisters the memory,
    # restore_kv_caches registers it again and puts the agent's new metadata in the
    # payload, and the engine core hands the payload to set_xfer_handshake_metadata, which
    # starts a new generation as it changed. vLLM's memory comes back at its addresses;
    # here new buffers take its place, the old ones kept (unregistered) so that a decode
    # reading with the old registration could only find the old bytes.
    agent, meta = kv["agent"], kv["meta"]
    agent.deregister_memory(kv["reg"])
    kv["retired"].append(kv["bufs"])
    salt = kv["salt"] + 1
    size = meta.num_blocks * meta.block_lens[0]
    bufs, reg = register_kv(agent, len(kv["bufs"]), size, salt)
    meta = dataclasses.replace(
        meta,
        agent_metadata=agent.get_agent_metadata(),
        kv_caches_base_addr=[b.ctypes.data + kv["shift"] for b in bufs],
    )
    kv.update(bufs=bufs, reg=reg, meta=meta, salt=salt)
    publish(encode_payload(kv["hash"], meta, kv["extra"]))
    return {"generation": kv["generation"], "salt": salt}


def kv_finish(req_id, groups, window, tokens):
    # vLLM 0.33's request_finished on a prefill (pull mode), one list per KV cache group; a
    # sliding window needs the blocks its tokens span, plus one for a window that starts
    # inside a block.
    if isinstance(window, str) and window.startswith("ssm:"):
        # A Mamba group keeps its running state's block: the last one before its
        # speculative scratch blocks (of which at least that one is left).
        scratch = min(int(window[4:]), max(len(groups[-1]) - 1, 0))
        kept = groups[-1][: len(groups[-1]) - scratch]
        groups[-1] = kept[-1:]
    elif window:
        keep = -(-window // kv["block_size"]) + 1
        groups[-1] = groups[-1][-keep:]
    return finished_params(req_id, groups, tokens or len(groups[0]) * kv["block_size"], None)


def finished_params(req_id, groups, tokens, expiry):
    """The params vLLM 0.33's pull request_finished returns for the kv engine's request
    REQ_ID of block lists GROUPS and TOKENS computed tokens: a prefill's (EXPIRY None) or,
    with bidirectional_kv_xfer, a decode's (is_d_node), whose blocks expire at EXPIRY on its
    perf_counter."""
    is_d_node = expiry is not None
    return dict(
        do_remote_prefill=not is_d_node,
        do_remote_decode=is_d_node,
        remote_block_ids=groups,
        remote_engine_id=kv["engine"],
        remote_request_id=req_id,
        remote_host="127.0.0.1",
        remote_port=kv["port"],
        tp_size=1,
        dcp_size=1,
        pp_size=1,
        remote_num_tokens=tokens,
        remote_blocks_expiry_time=expiry,
        remote_registration_generation=kv["generation"],
        transfer_mode="pull",
    )


def kv_keep(req_id, blocks, tokens, ttl):
    # vLLM 0.33's request_finished on a decode with bidirectional_kv_xfer (is_d_node): the
    # blocks stay pinned for decoder_kv_blocks_ttl seconds, a plain timeout rather than a
    # lease, and that deadline on this process's perf_counter is handed out with them.
    return finished_params(req_id, [blocks], tokens, time.perf_counter() + ttl)


def kv_remote(engine, port, local_hash):
    """The kv engine's handshake with ENGINE at PORT, once per engine as vLLM's
    _background_nixl_handshake: its agent adds the remote one -> (remote agent name,
    metadata, clock offset) or a dict saying why not."""
    remotes = kv.setdefault("remotes", {})
    if engine not in remotes:
        got = fetch_meta(port, local_hash, True, engine)
        if isinstance(got, dict):
            return got
        meta, _, offset = got
        remote = kv["agent"].add_remote_agent(meta.agent_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        remotes[engine] = (remote, meta, offset)
    return remotes[engine]


def matched_tokens(params, prompt, computed, threshold):
    """vLLM 0.33's get_num_new_matched_tokens on a prefill for params naming a decode's kept
    blocks: what the decode holds of the prompt past this engine's prefix cache, 0 below
    the recompute threshold (THRESHOLD, 0: none)."""
    count = min(params.get("remote_num_tokens") or 0, prompt) - computed
    if count <= 0 or (threshold > 0 and count < threshold):
        return 0
    return count


def kv_pull(params, local_hash, local, turn2):
    # vLLM 0.33's pull path on the kv engine, into its own KV cache: a turn-1 load (a
    # prefill's params) or, with TURN2 (prompt tokens, prefix-cached tokens, threshold), a
    # turn-2 read-back of a decode's kept blocks (do_remote_decode). LOCAL are the blocks
    # the scheduler allocated for the tokens counted; none (a full prefix hit, or below the
    # threshold) only notifies. A read-back whose blocks expire within the safety margin,
    # read on this clock through the handshake's offset, is declined: not read, nobody told
    # (_is_turn2_read_expired). The remote blocks are trimmed to the last len(LOCAL), the
    # uncached suffix (_apply_prefix_caching).
    tokens = None
    if turn2 is not None:
        assert params["do_remote_decode"] and not params["do_remote_prefill"], params
        prompt, computed, threshold = turn2
        tokens = matched_tokens(params, prompt, computed, threshold)
        bs = kv["block_size"]
        need = -(-(computed + tokens) // bs) - computed // bs if tokens else 0
        local = local[:need]
        if len(local) != need:
            return {"error": f"{need} blocks needed for {tokens} tokens"}
    got = kv_remote(params["remote_engine_id"], params["remote_port"], local_hash)
    if isinstance(got, dict):
        return got
    remote, meta, offset = got
    agent = kv["agent"]
    notif = f"{params['remote_request_id']}:1".encode()
    out = {"tokens": tokens, "clock_offset": offset}
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and local:
        deadline = expiry - offset
        out["left"] = deadline - time.perf_counter()
        if out["left"] <= EXPIRY_SAFETY_MARGIN:
            return dict(out, declined="expired")
    if not local:
        agent.send_notif(remote, notif_msg=notif)
        return dict(out, notified=True)
    [remote_ids] = params["remote_block_ids"]
    if len(local) > len(remote_ids):
        return {"error": "more local blocks than the remote holds"}
    remote_ids = remote_ids[-len(local):]
    lens, local_descs, remote_descs = kv["meta"].block_lens, [], []
    for region, buf in enumerate(kv["bufs"]):
        for mine, theirs in zip(local, remote_ids):
            at = meta.kv_caches_base_addr[region] + theirs * meta.block_strides[region]
            remote_descs.append((at, lens[region], meta.device_id))
            local_descs.append((buf.ctypes.data + mine * lens[region], lens[region], 0))
    failed = post_read(agent, remote, local_descs, remote_descs, notif)
    if failed:
        return failed
    data = b"".join(
        buf[b * lens[r] : (b + 1) * lens[r]].tobytes()
        for r, buf in enumerate(kv["bufs"])
        for b in local
    )
    return dict(out, remote_blocks=remote_ids, data=data.hex())


def kv_notifs(count, seconds):
    agent, notifs = kv["agent"], kv["notifs"]
    deadline = time.monotonic() + seconds
    while len(notifs) < count and time.monotonic() < deadline:
        for sender, notes in agent.get_new_notifs().items():
            notifs.extend((sender, n) for n in notes)
        time.sleep(0.001)
    taken, kv["notifs"] = notifs[:count], notifs[count:]
    out = []
    for sender, note in taken:
        try:
            vllm = parse_notif(note)
        except (ValueError, UnicodeDecodeError) as e:
            vllm = {"error": str(e)}
        out.append({"from": sender, "hex": note.hex(), "vllm": vllm})
    return out


def fetch_meta(port, local_hash, enforce, engine, tp=0, pp=0):
    """vLLM's decode handshake with rank (PP, TP) of the ROUTER at PORT: get_meta_msg, the hash
    checked before the metadata is decoded -> (metadata, reply frames, clock offset) or a
    dict saying why not. The clock offset is vLLM's estimate of the remote perf_counter
    less ours: the remote's timestamp less the midpoint of the round trip."""
    sock = req(port, 5000)
    try:
        start = time.perf_counter()
        sock.send(msgspec.msgpack.encode((GET_META_MSG, pp, tp)))
        parts = sock.recv_multipart()
        offset = msgspec.msgpack.decode(parts[1]) - (start + time.perf_counter()) / 2
    except zmq.Again:
        return {"error": "timeout"}
    finally:
        sock.close()
    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(parts[0])
    # vLLM's order: the hash before the metadata is decoded.
    if enforce and payload.compatibility_hash != local_hash:
        return {"mismatch": [local_hash, payload.compatibility_hash]}
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    if meta.engine_id != engine:
        return {"error": f"engine id {meta.engine_id}, expected {engine}"}
    return meta, parts, offset


def decode_agent(port, local_hash, enforce, engine):
    """fetch_meta, then a new agent that adds the remote one -> (agent, remote agent name,
    metadata, reply frames) or a dict saying why not."""
    from nixl_cu12 import nixl_agent

    got = fetch_meta(port, local_hash, enforce, engine)
    if isinstance(got, dict):
        return got
    meta, parts, _ = got
    decodes[0] += 1
    agent = nixl_agent(f"py-decode-{os.getpid()}-{decodes[0]}")
    remote = agent.add_remote_agent(meta.agent_metadata)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    return agent, remote, meta, parts


def kv_heartbeat(port, local_hash, enforce, engine, count, prefix):
    """A decode waiting for COUNT requests of the prefill: vLLM's _send_heartbeats message,
    one HB: notification naming ids PREFIX-0 ... PREFIX-(COUNT-1), each left-padded with
    'x' to 48 characters -> JSON {bytes} or the refusal."""
    got = decode_agent(port, local_hash, enforce, engine)
    if isinstance(got, dict):
        return got
    agent, remote, _, _ = got
    ids = [f"{prefix}-{i}".rjust(48, "x") for i in range(count)]
    hb_msg = ("HB:" + ",".join(ids)).encode()
    agent.send_notif(remote, notif_msg=hb_msg)
    heartbeat_agents.append(agent)
    return {"bytes": len(hb_msg)}


def read_blocks(agent, remote, meta, blocks, notif, ssm=None):
    """READs BLOCKS of every region of REMOTE (its metadata META) into a buffer AGENT
    registers, notifying NOTIF, and with SSM ((conv, temporal), block) then a Mamba state
    block as vLLM's decode reads it -> the buffer's bytes, or a dict saying why not."""
    lens = meta.block_lens
    size = sum(lens) * len(blocks)
    ssm_descs = []
    if ssm:
        (conv, temporal), block = ssm
        if tuple(meta.ssm_sizes) != (sum(conv), temporal):
            return {"error": f"ssm_sizes {meta.ssm_sizes}, expected {(sum(conv), temporal)}"}
        # vLLM's [descs_fa | descs_ssm]: region by region, part by part.
        for region, base in enumerate(meta.kv_caches_base_addr):
            for offset, length in ssm_parts(conv, temporal):
                ssm_descs.append((base + block * meta.block_strides[region] + offset, length))
        size += sum(length for _, length in ssm_descs)
    buf = np.zeros(size, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, size, 0, "")], "DRAM"))
    local_descs, remote_descs, at = [], [], buf.ctypes.data
    for region, base in enumerate(meta.kv_caches_base_addr):
        for b in blocks:
            remote_descs.append((base + b * meta.block_strides[region], lens[region], meta.device_id))
            local_descs.append((at, lens[region], 0))
            at += lens[region]
    for address, length in ssm_descs:
        remote_descs.append((address, length, meta.device_id))
        local_descs.append((at, length, 0))
        at += length
    failed = post_read(agent, remote, local_descs, remote_descs, notif)
    return failed or buf.tobytes()


def post_read(agent, remote, local_descs, remote_descs, notif, op="READ"):
    """One READ (or OP) of REMOTE_DESCS into (from) LOCAL_DESCS (DRAM) notifying NOTIF,
    waited for (at most 10 s) -> None once done, or a dict saying why not."""
    handle = agent.initialize_xfer(
        op,
        agent.get_xfer_descs(local_descs, "DRAM"),
        agent.get_xfer_descs(remote_descs, "DRAM"),
        remote,
        notif,
    )
    state = agent.transfer(handle)
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        return {"error": f"{op} ended {state}"}
    return None


def kv_decode(port, local_hash, enforce, engine, blocks, req_id, consumers, ssm=None):
    got = decode_agent(port, local_hash, enforce, engine)
    if isinstance(got, dict):
        return got
    agent, remote, meta, parts = got
    data = read_blocks(agent, remote, meta, blocks, f"{req_id}:{consumers}".encode(), ssm)
    if isinstance(data, dict):
        return data
    return {
        "data": data.hex(),
        "agent": remote,
        "meta": {
            "num_blocks": meta.num_blocks,
            "block_lens": meta.block_lens,
            "block_size": meta.block_size,
            "kv_cache_layout": meta.kv_cache_layout,
            "region_names": meta.region_names,
            "region_group_ids": meta.region_group_ids,
            "region_mem_types": meta.region_mem_types,
            "ssm_sizes": list(meta.ssm_sizes),
        },
        "remote_perf_is_float": isinstance(msgspec.msgpack.decode(parts[1]), float),
    }


def kv_load(params, local_hash, consumers):
    # vLLM 0.33's pull worker: _read_blocks_for_req compares the params' generation with
    # the one it stored for the engine (0 if none) and, below it, drops the engine
    # (_cleanup_remote_engine removes its remote agent); an engine not loaded is
    # handshaken with (_background_nixl_handshake) before its blocks are read.
    from nixl_cu12 import nixl_agent

    if puller["agent"] is None:
        puller["agent"] = nixl_agent(f"py-puller-{os.getpid()}")
    agent = puller["agent"]
    engine = params["remote_engine_id"]
    generation = params.get("remote_registration_generation", 0)
    if puller["generations"].get(engine, 0) < generation:
        if engine in puller["engines"]:
            remote, _ = puller["engines"].pop(engine)
            agent.remove_remote_agent(remote)
        puller["generations"][engine] = generation
    handshaken = engine not in puller["engines"]
    if handshaken:
        got = fetch_meta(params["remote_port"], local_hash, True, engine)
        if isinstance(got, dict):
            return got
        meta = got[0]
        remote = agent.add_remote_agent(meta.agent_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        puller["engines"][engine] = (remote, meta)
    remote, meta = puller["engines"][engine]
    [blocks] = params["remote_block_ids"]
    notif = f"{params['remote_request_id']}:{consumers}".encode()
    try:
        data = read_blocks(agent, remote, meta, blocks, notif)
    except Exception as e:  # NIXL's errors, e.g. descriptors its loaded metadata lacks
        return {"error": f"READ: {e}", "handshaken": handshaken}
    if isinstance(data, dict):
        return data
    return {"data": data.hex(), "handshaken": handshaken, "generation": generation}


def kv_dcp_prefill(hash_, engine, dcp, regions, blocks, block_len, block_size, pcp=1):
    from nixl_cu12 import nixl_agent

    payloads, names = {}, []
    for rank in range(dcp):
        name = f"py-dcp-prefill-{os.getpid()}-{rank}"
        agent = nixl_agent(name)
        bufs, reg = register_kv(agent, regions, blocks * block_len, rank)
        addrs = [b.ctypes.data for b in bufs]
        meta = dram_metadata(
            engine, agent, addrs, blocks, block_len, block_size, dcp_size=dcp, pcp_size=pcp
        )
        payloads[(0, rank)] = encode_payload(hash_, meta, False)
        dcp_prefill["ranks"].append((agent, bufs, reg))
        names.append(name)
    return {"port": serve_ranks(payloads), "agents": names}


def kv_dcp_notifs(count, seconds):
    notifs = dcp_prefill["notifs"]
    deadline = time.monotonic() + seconds
    while len(notifs) < count and time.monotonic() < deadline:
        for rank, (agent, _, _) in enumerate(dcp_prefill["ranks"]):
            for sender, notes in agent.get_new_notifs().items():
                notifs.extend((rank, sender, n) for n in notes)
        time.sleep(0.001)
    taken, dcp_prefill["notifs"] = notifs[:count], notifs[count:]
    return [{"rank": r, "from": s, "vllm": parse_notif(n)} for r, s, n in taken]


def shared_positions(positions, mine, theirs):
    """The global positions below POSITIONS that both ranks hold, each rank given as (DCP
    size, DCP rank): position g lives on DCP rank g % size, as its block g // size."""
    return [g for g in range(positions)
            if g % mine[0] == mine[1] and g % theirs[0] == theirs[1]]


def pcp_refusal(local_dcp, remote_pcp, remote_dcp):
    """What vLLM 0.33's decode (PCP 1, DCP LOCAL_DCP) says of a remote engine whose metadata
    gives REMOTE_PCP and REMOTE_DCP (its _validate_remote_parallel_config): its refusal, or
    None where it pairs them."""
    if remote_pcp > 1 and remote_dcp not in (1, remote_pcp):
        return ("Remote NixlConnector PCP+DCP does not span the full PCP group. "
                f"Remote PCP/DCP={remote_pcp}/{remote_dcp}.")
    if remote_pcp > 1 and remote_dcp == 1 and local_dcp > 1:
        return ("Replicated PCP cannot be paired with a DCP-sharded NIXL peer. "
                f"Local PCP/DCP=1/{local_dcp}; remote PCP/DCP={remote_pcp}/{remote_dcp}.")
    return None


def kv_dcp_decode(params, local_hash, dcp, rank, consumers):
    from nixl_cu12 import nixl_agent

    port, engine = params["remote_port"], params["remote_engine_id"]
    remote_tp, remote_dcp = params["tp_size"], params.get("dcp_size", 1)
    [remote_ids] = params["remote_block_ids"]
    notif = f"{params['remote_request_id']}:{consumers}".encode()
    decodes[0] += 1
    agent = nixl_agent(f"py-dcp-decode-{os.getpid()}-{decodes[0]}")
    # The remote ranks whose positions may meet ours: those of our DCP rank modulo the
    # smaller DCP size (an unsharded side holds every position).
    smaller = min(dcp, remote_dcp)
    sources = [r for r in range(remote_tp) if r % smaller == rank % smaller]
    out = {"positions": {}, "read": {}, "notified_only": []}
    for r in sources:
        got = fetch_meta(port, local_hash, True, engine, tp=r)
        if isinstance(got, dict):
            return got
        meta = got[0]
        refusal = pcp_refusal(dcp, meta.pcp_size, meta.dcp_size)
        if refusal:
            return {"refused": refusal}
        if meta.dcp_size != remote_dcp:
            return {"error": f"rank {r}: metadata dcp_size {meta.dcp_size}, params {remote_dcp}"}
        remote = agent.add_remote_agent(meta.agent_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        positions = -(-params["remote_num_tokens"] // meta.block_size)
        shared = shared_positions(positions, (dcp, rank % dcp), (remote_dcp, r % remote_dcp))
        if not shared:
            agent.send_notif(remote, notif_msg=notif)
            out["notified_only"].append(r)
            continue
        blocks = [remote_ids[g // remote_dcp] for g in shared]
        data = read_blocks(agent, remote, meta, blocks, notif)
        if isinstance(data, dict):
            return data
        # read_blocks lays the blocks out region by region.
        lens = meta.block_lens
        for i, g in enumerate(shared):
            parts, at = [], 0
            for length in lens:
                parts.append(data[at + i * length: at + (i + 1) * length])
                at += length * len(shared)
            out["positions"][g] = b"".join(parts).hex()
        out["read"][r] = len(shared)
    return out


def pp_stages(layers, pp):
    """(first layer, layers) of each of PP stages: LAYERS // PP each, the rest added one
    at a time to the stages before the last, starting from the second-to-last."""
    sizes = [layers // pp] * pp
    for extra in range(layers % pp):
        sizes[pp - 2 - extra] += 1
    firsts = [sum(sizes[:s]) for s in range(pp)]
    return list(zip(firsts, sizes))


def kv_pp_prefill(hash_, engine, pp, tp, layers, blocks, block_len, block_size):
    from nixl_cu12 import nixl_agent

    stages = pp_stages(layers, pp)
    payloads, names = {}, {}
    for s, (first, count) in enumerate(stages):
        for t in range(tp):
            name = f"py-pp-prefill-{os.getpid()}-{s}-{t}"
            agent = nixl_agent(name)
            size = blocks * block_len
            bufs = [kv_byte(first + g, size, t) for g in range(count)]
            descs = [(b.ctypes.data, size, 0, "") for b in bufs]
            reg = agent.get_reg_descs(descs, "DRAM")
            agent.register_memory(reg)
            addrs = [b.ctypes.data for b in bufs]
            meta = dram_metadata(engine, agent, addrs, blocks, block_len, block_size, first)
            payloads[(s, t)] = encode_payload(hash_, meta, False)
            pp_prefill["ranks"][(s, t)] = (agent, bufs, reg)
            names[f"{s}:{t}"] = name
    port = serve_ranks(payloads)
    pp_prefill.update(engine=engine, port=port, pp=pp, tp=tp, block_len=block_len, layers=layers)
    return {"port": port, "stages": stages, "agents": names}


def kv_pp_decode(port, local_hash, engine, layers, pp, stage, blocks, req_id, consumers):
    """One stage's part of a decode of one stage and TP 1 reading a prefill of PP stages of
    TP 1 over LAYERS layers, on vLLM's wire: the handshake with remote rank (STAGE, 0) (as
    vLLM's _nixl_handshake asks every remote (pp_rank, tp_rank)), the stage's regions
    counted against vLLM's layer split and read, and the stage notified
    "REQ_ID:CONSUMERS". One agent reads every stage, as one decode rank would. Not vLLM
    0.33's own pull decode, which handshakes with every stage but reads from pp_rank 0
    alone (pull_worker.py's _read_blocks): a reader of every stage, for a prefill's stages
    -> JSON {first_layer, layers, agent, data hex (region by region, block by block)} or a
    dict saying why not."""
    from nixl_cu12 import nixl_agent

    if pp_decoder["agent"] is None:
        pp_decoder["agent"] = nixl_agent(f"py-pp-decode-{os.getpid()}")
    agent = pp_decoder["agent"]
    got = fetch_meta(port, local_hash, True, engine, tp=0, pp=stage)
    if isinstance(got, dict):
        return got
    meta = got[0]
    first, count = pp_stages(layers, pp)[stage]
    if len(meta.kv_caches_base_addr) != count:
        return {"error": f"stage {stage}: {len(meta.kv_caches_base_addr)} regions, vLLM's split gives {count}"}
    remote = agent.add_remote_agent(meta.agent_metadata)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    data = read_blocks(agent, remote, meta, blocks, f"{req_id}:{consumers}".encode())
    if isinstance(data, dict):
        return data
    return {"first_layer": first, "layers": count, "agent": remote, "data": data.hex()}


def prefill_finished_params(req_id, groups, side, tokens, mode):
    """The params vLLM 0.33's request_finished returns on a prefill of stages (SIDE: its
    engine, port, pp and, if not 1, tp) for REQ_ID of block lists GROUPS and TOKENS computed
    tokens, in transfer MODE: pull's with no expiry time (a lease decides), push's without."""
    params = dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_block_ids=groups,
        remote_engine_id=side["engine"],
        remote_request_id=req_id,
        remote_host="127.0.0.1",
        remote_port=side["port"],
        tp_size=side.get("tp", 1),
        dcp_size=1,
        pp_size=side["pp"],
        remote_num_tokens=tokens,
        transfer_mode=mode,
    )
    if mode == "pull":
        params["remote_blocks_expiry_time"] = None
    return params


def kv_pp_finish(req_id, blocks):
    return prefill_finished_params(req_id, [blocks], pp_prefill, len(blocks) * 16, "pull")


def kv_pp_push_finish(req_id, blocks):
    """vLLM's push request_finished on the PP prefill for REQ_ID of (one group's) BLOCKS:
    every rank holds them for a registration -> the push params (no expiry time)."""
    pp_prefill.setdefault("push", {})[req_id] = blocks
    return prefill_finished_params(req_id, [blocks], pp_prefill, len(blocks) * 16, "push")


def kv_pp_push_write(local_hash, seconds):
    """Every rank of the PP prefill as vLLM's push writer, for the first registration its
    own agent gets (at most SECONDS in all) whose request id, or base id, it holds: the
    handshake with the decode rank it writes (hash LOCAL_HASH checked), its stage's layers'
    blocks cut to the last as many as the decode registered, each WRITTEN into the
    decode's region of the same layer, at its heads' place in the decode's block (HND:
    rank t of a prefill of TP times the decode's writes the t-th slice of a decode rank's
    block), with the notification "{decode request id}:{prefill TP}" (vLLM's world size)
    -> JSON {ranks: {"s:t": {written, into, agent, slot}}} or why not."""
    held, tp = pp_prefill.get("push", {}), pp_prefill["tp"]
    stages = pp_stages(pp_prefill["layers"], pp_prefill["pp"])
    size = pp_prefill["block_len"]
    agents = {rank: agent for rank, (agent, _, _) in pp_prefill["ranks"].items()}
    regs, out = take_registrations(agents, held, seconds), {}
    if "error" in regs:
        return regs
    for (s, t), (reg, key) in regs.items():
        agent, bufs, _ = pp_prefill["ranks"][(s, t)]
        writers = max(1, tp // reg["decode_tp_size"])
        decode_rank, slot = t // writers, t % writers
        fetched = fetch_meta(reg["decode_port"], local_hash, True, reg["decode_engine_id"], tp=decode_rank)
        if isinstance(fetched, dict):
            return dict(rank=f"{s}:{t}", **fetched)
        meta = fetched[0]
        remote = agent.add_remote_agent(meta.agent_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        theirs = reg["local_block_ids"][0]
        mine = held[key][-len(theirs):]
        first, count = stages[s]
        local_descs, remote_descs = [], []
        for g in range(count):
            layer = first + g
            for m, d in zip(mine, theirs):
                at = meta.kv_caches_base_addr[layer] + d * meta.block_strides[layer] + slot * size
                remote_descs.append((at, size, meta.device_id))
                local_descs.append((bufs[g].ctypes.data + m * size, size, 0))
        notif = f"{reg['request_id']}:{tp}".encode()
        failed = post_read(agent, remote, local_descs, remote_descs, notif, "WRITE")
        if failed:
            return dict(rank=f"{s}:{t}", **failed)
        out[f"{s}:{t}"] = {"written": mine, "into": theirs, "agent": remote, "slot": slot}
    return {"ranks": out}


def take_registrations(agents, held, seconds):
    """The first PUSH_REG registration each rank's agent of AGENTS ((s, t) -> agent) gets,
    at most SECONDS in all, whose request id, or base id, HELD holds (vLLM's push matching)
    -> {(s, t): (registration, held request id)} or why not."""
    deadline = time.monotonic() + seconds
    regs = {}
    while len(regs) < len(agents):
        if time.monotonic() > deadline:
            return {"error": "no registration on every rank", "ranks": sorted(f"{s}:{t}" for s, t in regs)}
        for rank, agent in agents.items():
            for sender, notes in agent.get_new_notifs().items():
                for note in notes:
                    if rank in regs or not note.startswith(b"PUSH_REG:"):
                        continue
                    reg = msgspec.msgpack.decode(note[len(b"PUSH_REG:"):])
                    rid = reg["request_id"]
                    key = rid if rid in held else next(
                        (h for h in held if base_id(h) == base_id(rid)), None)
                    if key is not None:
                        regs[rank] = (reg, key)
        time.sleep(0.001)
    return regs


def hma_regions(layers):
    """vLLM's KV tensors of a rank holding LAYERS (layer numbers) of a hybrid model of two
    groups, full attention (0) at the even layers and a sliding window (1) at the odd ones:
    tensor i shared by the i-th of the rank's layers of each group (vLLM's
    get_kv_cache_config_from_groups) -> [[(layer name, group), ...], ...]."""
    groups = [[l for l in layers if l % 2 == g] for g in (0, 1)]
    return [[(f"model.layers.{members[i]}.attn", g) for g, members in enumerate(groups) if i < len(members)]
            for i in range(max(len(m) for m in groups))]


def hma_rank(agent_name, hash_engine, regions, bufs, block_len, block_size):
    """One rank of the hybrid model holding REGIONS (as hma_regions gives them) in BUFS (one
    per region, whole blocks of BLOCK_LEN): an agent named AGENT_NAME registering them, and
    its payload for ENGINE under HASH naming each region's layers in region_members
    (region_group_ids -1: shared) -> (agent, registration, names, payload)."""
    from nixl_cu12 import nixl_agent

    hash_, engine = hash_engine
    agent = nixl_agent(agent_name)
    size = len(bufs[0])
    reg = agent.get_reg_descs([(b.ctypes.data, size, 0, "") for b in bufs], "DRAM")
    agent.register_memory(reg)
    members = [[name for name, _ in region] for region in regions]
    meta = dram_metadata(
        engine, agent, [b.ctypes.data for b in bufs], size // block_len, block_len, block_size,
        region_group_ids=[-1] * len(regions),
        region_names=[m[0] for m in members],
        region_members=members,
    )
    return agent, reg, members, encode_payload(hash_, meta, False)


def kv_hma_pp_prefill(hash_, engine, pp, layers, blocks, block_len, block_size):
    """A prefill of PP stages of TP 1 of the hybrid model of hma_regions over LAYERS layers,
    vLLM's push connector's layout: each stage's tensors from its own layers, named in its
    metadata's region_members, region_group_ids -1 (shared); stage s's region r holds
    kv_byte(100 s + r) -> JSON {port, regions (each stage's names)}."""
    payloads, out = {}, []
    for s, (first, count) in enumerate(pp_stages(layers, pp)):
        regions = hma_regions(range(first, first + count))
        bufs = [kv_byte(100 * s + r, blocks * block_len) for r in range(len(regions))]
        agent, reg, members, payloads[(s, 0)] = hma_rank(
            f"py-hma-prefill-{os.getpid()}-{s}", (hash_, engine), regions, bufs, block_len, block_size)
        hma_pp["ranks"][(s, 0)] = (agent, bufs, reg, regions)
        out.append(members)
    port = serve_ranks(payloads)
    hma_pp.update(engine=engine, port=port, pp=pp, block_len=block_len, block_size=block_size)
    return {"port": port, "regions": out}


def kv_hma_pp_push_finish(req_id, groups):
    """vLLM's push request_finished on the hybrid prefill for REQ_ID of GROUPS (its block ids
    per group, the window's not clipped): held on every rank -> the push params."""
    hma_pp["push"][req_id] = groups
    tokens = len(groups[0]) * hma_pp["block_size"]
    return prefill_finished_params(req_id, groups, hma_pp, tokens, "push")


def kv_hma_pp_push_write(local_hash, seconds):
    """Every stage of the hybrid prefill as vLLM's push writer, for the first registration
    it gets (at most SECONDS): the handshake with the decode (TP 1, hash LOCAL_HASH checked),
    its regions aligned by layer name as vLLM's _align_remote_regions_by_layer aligns them
    (each local layer, region by region, in the decode's region of region_members naming
    it: every one there, none twice), and its descriptors as vLLM's _compute_desc_ids with
    layer-name routing lays them out: layer by layer, each with its own group's blocks, the
    held ones cut to the last as many as the decode registered for the group; WRITTEN with
    "{decode request id}:1" -> JSON {ranks: {"s:0": {layers: [[name, decode region]],
    descs}}} or why not."""
    held, size = hma_pp["push"], hma_pp["block_len"]
    agents = {rank: agent for rank, (agent, _, _, _) in hma_pp["ranks"].items()}
    regs, out = take_registrations(agents, held, seconds), {}
    if "error" in regs:
        return regs
    for (s, t), (reg, key) in regs.items():
        agent, bufs, _, regions = hma_pp["ranks"][(s, t)]
        fetched = fetch_meta(reg["decode_port"], local_hash, True, reg["decode_engine_id"])
        if isinstance(fetched, dict):
            return dict(rank=f"{s}:{t}", **fetched)
        meta = fetched[0]
        if not meta.region_members:
            return {"rank": f"{s}:{t}", "error": "Remote advertised no region_members"}
        region_of = {}
        for r, names in enumerate(meta.region_members):
            for name in names:
                if name in region_of:
                    return {"rank": f"{s}:{t}", "error": f"Remote advertised layer {name!r} in multiple regions"}
                region_of[name] = r
        missing = [n for region in regions for n, _ in region if n not in region_of]
        if missing:
            return {"rank": f"{s}:{t}", "error": f"Remote is missing locally owned layers: {missing}"}
        remote = agent.add_remote_agent(meta.agent_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        local_descs, remote_descs, routed = [], [], []
        for r, region in enumerate(regions):
            for name, g in region:
                into = region_of[name]
                routed.append([name, into])
                theirs = reg["local_block_ids"][g]
                mine = held[key][g][-len(theirs):] if theirs else []
                for m, d in zip(mine, theirs):
                    at = meta.kv_caches_base_addr[into] + d * meta.block_strides[into]
                    remote_descs.append((at, size, meta.device_id))
                    local_descs.append((bufs[r].ctypes.data + m * size, size, 0))
        failed = post_read(agent, remote, local_descs, remote_descs, f"{reg['request_id']}:1".encode(), "WRITE")
        if failed:
            return dict(rank=f"{s}:{t}", **failed)
        out[f"{s}:{t}"] = {"layers": routed, "descs": len(local_descs)}
    return {"ranks": out}


def kv_hma_decode(hash_, engine, layers, blocks, block_len, block_size):
    """A push decode (one stage, TP 1) of the hybrid model of hma_regions over LAYERS
    layers: its tensors registered (zero) and named in its metadata's region_members, served
    at (0, 0) under HASH -> JSON {port, regions}."""
    regions = hma_regions(range(layers))
    bufs = [np.zeros(blocks * block_len, dtype=np.uint8) for _ in regions]
    agent, reg, members, payload = hma_rank(
        f"py-hma-decode-{os.getpid()}", (hash_, engine), regions, bufs, block_len, block_size)
    port = serve_ranks({(0, 0): payload})
    hma_decode.update(agent=agent, bufs=bufs, reg=reg, port=port, engine=engine, notifs=[])
    return {"port": port, "regions": members}


def kv_hma_push_register(params, local_hash, req_id, groups):
    """The hybrid decode as vLLM's push decode for the prefill's JSON PARAMS: a handshake
    (hash checked) with every (pp_rank, tp_rank) of the prefill, then one PUSH_REG to each,
    vLLM's eleven keys, its blocks GROUPS one list per group -> JSON {stages, agents} or why
    not."""
    agents = []
    for pp in range(params.get("pp_size", 1)):
        for tp in range(params["tp_size"]):
            got = fetch_meta(params["remote_port"], local_hash, True, params["remote_engine_id"], tp=tp, pp=pp)
            if isinstance(got, dict):
                return dict(pp=pp, tp=tp, **got)
            remote = hma_decode["agent"].add_remote_agent(got[0].agent_metadata)
            agents.append(remote.decode() if isinstance(remote, bytes) else remote)
    msg = push_registration(req_id, (hma_decode["engine"], "127.0.0.1", hma_decode["port"]), groups, params)
    for agent in agents:
        hma_decode["agent"].send_notif(agent, notif_msg=msg)
    return {"stages": params.get("pp_size", 1), "agents": agents}


def kv_hma_push_wait(req_id, count, seconds):
    """The hybrid decode waiting, at most SECONDS, for COUNT notifications "REQ_ID:N" (vLLM's
    push decode waits for pp_size x max(1, N / its TP)), others kept; then every region's
    bytes, whole, region by region -> JSON {vllm (the first's), senders, data} or why not."""
    deadline = time.monotonic() + seconds
    seen = []
    while len(seen) < count and time.monotonic() < deadline:
        for sender, notes in hma_decode["agent"].get_new_notifs().items():
            for note in notes:
                try:
                    parsed = parse_notif(note)
                except (ValueError, UnicodeDecodeError):
                    continue
                if parsed.get("id") == req_id:
                    seen.append((sender, parsed))
                else:
                    hma_decode["notifs"].append((sender, note))
        time.sleep(0.001)
    if len(seen) < count:
        return {"error": "no WRITE notification", "seen": len(seen)}
    data = b"".join(buf.tobytes() for buf in hma_decode["bufs"])
    return {"vllm": seen[0][1], "senders": [s for s, _ in seen], "data": data.hex()}


def kv_pp_notifs(count, seconds):
    pending = pp_prefill["pending"]
    deadline = time.monotonic() + seconds
    while len(pending) < count and time.monotonic() < deadline:
        for rank, (agent, _, _) in pp_prefill["ranks"].items():
            for sender, notes in agent.get_new_notifs().items():
                for note in notes:
                    if not note.startswith(b"HB:"):
                        pending.append((rank, sender, note))
        time.sleep(0.001)
    taken, pp_prefill["pending"] = pending[:count], pending[count:]
    counts, freed = pp_prefill["counts"], pp_prefill["freed"]
    out = []
    for rank, sender, note in taken:
        vllm = parse_notif(note)
        key = (rank, vllm["id"])
        seen, _ = counts.get(key, (0, 0))
        # Every reader says the same count; the rank frees once that many notified.
        counts[key] = (seen + 1, vllm["consumers"])
        if seen + 1 == vllm["consumers"]:
            freed.setdefault(rank, []).append(vllm["id"])
            del counts[key]
        out.append({"rank": f"{rank[0]}:{rank[1]}", "from": sender, "vllm": vllm})
    ranks = list(pp_prefill["ranks"])
    ids = {i for r in ranks for i in freed.get(r, [])}
    engine_freed = sorted(i for i in ids if all(i in freed.get(r, []) for r in ranks))
    return {
        "notes": out,
        "freed": {f"{s}:{t}": freed.get((s, t), []) for s, t in ranks},
        "engine_freed": engine_freed,
    }


# The kv_prefill engine in vLLM's push mode: its finished requests' blocks waiting for a
# decode's registration (request id -> block lists), and the registrations taken that no
# finished request matched yet (sender, raw notification), in arrival order.
push = {"finished": {}, "regs": []}


def base_id(request_id):
    """A request id without the random suffix vLLM's input processor appends to it: a dash
    and 8 hex digits at the very end."""
    tail = request_id[-8:]
    if len(request_id) >= 9 and request_id[-9] == "-" and all(c in "0123456789abcdefABCDEF" for c in tail):
        return request_id[:-9]
    return request_id


def kv_push_finish(req_id, blocks, tokens):
    """vLLM 0.33's push request_finished on the kv engine for request REQ_ID of (one group's)
    BLOCKS: they wait for a registration, and the params say push, without the pull-only
    expiry time and registration generation."""
    push["finished"][req_id] = [blocks]
    params = finished_params(req_id, [blocks], tokens or len(blocks) * kv["block_size"], None)
    del params["remote_blocks_expiry_time"]
    del params["remote_registration_generation"]
    params["transfer_mode"] = "push"
    return params


def take_push_notifs():
    """Drains the kv engine's notifications: registrations to push["regs"], the rest
    (heartbeats among them) to kv["notifs"] for kv_notifs."""
    for sender, notes in kv["agent"].get_new_notifs().items():
        sender = sender.decode() if isinstance(sender, bytes) else sender
        for note in notes:
            if note.startswith(b"PUSH_REG:"):
                push["regs"].append((sender, note))
            else:
                kv["notifs"].append((sender, note))


def match_registration():
    """The first registration taken whose request id is a finished request's, or has its
    base id -> (sender, raw, registration, finished id), both taken out; or None."""
    for i, (sender, raw) in enumerate(push["regs"]):
        reg = msgspec.msgpack.decode(raw[len(b"PUSH_REG:"):])
        rid, finished = reg["request_id"], push["finished"]
        key = rid if rid in finished else next(
            (f for f in finished if base_id(f) == base_id(rid)), None)
        if key is not None:
            del push["regs"][i]
            return sender, raw, reg, key
    return None


def kv_push_write(local_hash, seconds, delay):
    """The kv engine as vLLM's push writer: waits (at most SECONDS) for a registration that
    matches a finished request, holds DELAY seconds more (notifications still taken), then
    handshakes with the registering decode (its hash checked against LOCAL_HASH), cuts its
    blocks to the last as many as the decode registered (a prefix hit) and WRITEs them
    into the decode's, every region, with the notification "{decode request id}:1" (this
    engine's TP size) -> JSON of the registration and what was written, or why not."""
    deadline = time.monotonic() + seconds
    got = None
    while got is None:
        take_push_notifs()
        got = match_registration()
        if got is None:
            if time.monotonic() > deadline:
                return {"error": "no registration matched", "regs": len(push["regs"])}
            time.sleep(0.001)
    sender, raw, reg, key = got
    blocks = push["finished"].pop(key)
    until = time.monotonic() + delay
    while time.monotonic() < until:
        take_push_notifs()
        time.sleep(0.005)
    out = {"registration": reg, "hex": raw.hex(), "from": sender, "matched": key}
    fetched = fetch_meta(reg["decode_port"], local_hash, True, reg["decode_engine_id"])
    if isinstance(fetched, dict):
        return dict(out, **fetched)
    meta = fetched[0]
    agent = kv["agent"]
    remote = agent.add_remote_agent(meta.agent_metadata)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    theirs = reg["local_block_ids"][0]
    mine = blocks[0][-len(theirs):]
    lens, local_descs, remote_descs = kv["meta"].block_lens, [], []
    for region, buf in enumerate(kv["bufs"]):
        for m, t in zip(mine, theirs):
            at = meta.kv_caches_base_addr[region] + t * meta.block_strides[region]
            remote_descs.append((at, lens[region], meta.device_id))
            local_descs.append((buf.ctypes.data + m * lens[region], lens[region], 0))
    notif = f"{reg['request_id']}:1".encode()
    failed = post_read(agent, remote, local_descs, remote_descs, notif, "WRITE")
    if failed:
        return dict(out, **failed)
    return dict(out, written=mine, into=theirs, agent=remote)


def push_registration(req_id, decode, groups, params):
    """vLLM's push decode's registration (TP 1) of its request REQ_ID and its blocks GROUPS
    (one list per group) with the prefill of the JSON PARAMS, DECODE its (engine id, side
    channel host, port): PUSH_REG and the eleven keys of vLLM's push scheduler in its
    order."""
    engine, host, port = decode
    reg = {
        "request_id": req_id,
        "decode_engine_id": engine,
        "decode_host": host,
        "decode_port": port,
        "decode_tp_size": 1,
        "local_block_ids": groups,
        "remote_engine_id": params["remote_engine_id"],
        "remote_host": params["remote_host"],
        "remote_port": params["remote_port"],
        "remote_tp_size": params["tp_size"],
        "remote_pp_size": params.get("pp_size", 1),
    }
    return b"PUSH_REG:" + msgspec.msgpack.encode(reg)


def kv_push_register(params, local_hash, req_id, local, host):
    """The kv engine as vLLM's push decode (TP 1) for the prefill's JSON PARAMS: a handshake
    (hash checked) once per engine (and with each of its other TP ranks), then one PUSH_REG
    notification to each rank's agent, the
    eleven keys of vLLM's push scheduler in its order, for its own request REQ_ID and its
    freshly allocated blocks LOCAL (one group), its side channel named HOST
    -> JSON {hex} or why not."""
    got = kv_remote(params["remote_engine_id"], params["remote_port"], local_hash)
    if isinstance(got, dict):
        return got
    remote = got[0]
    # vLLM's decode (TP 1) registers with every prefill rank it handshook with: all of its
    # TP ranks.
    agents = [remote]
    for rank in range(1, params["tp_size"]):
        fetched = fetch_meta(params["remote_port"], local_hash, True, params["remote_engine_id"], tp=rank)
        if isinstance(fetched, dict):
            return fetched
        other = kv["agent"].add_remote_agent(fetched[0].agent_metadata)
        agents.append(other.decode() if isinstance(other, bytes) else other)
    msg = push_registration(req_id, (kv["engine"], host, kv["port"]), [local], params)
    for agent in agents:
        kv["agent"].send_notif(agent, notif_msg=msg)
    return {"hex": msg.hex(), "agent": remote, "agents": agents}


def kv_push_hb(engine, ids):
    """vLLM's heartbeat from the kv engine to ENGINE's agent (handshaken by
    kv_push_register or kv_pull), naming IDS."""
    remote = kv["remotes"][engine][0]
    kv["agent"].send_notif(remote, notif_msg=("HB:" + ",".join(ids)).encode())
    return "ok"


def kv_push_wait(req_id, local, seconds, count=1):
    """vLLM's push decode waiting for its request REQ_ID: COUNT notifications naming it
    ("REQ_ID:N", the prefill ranks' WRITEs: vLLM's decode waits for pp_size x max(1, N / its
    TP) of them), waited for at most SECONDS in all, and then the bytes of its blocks LOCAL,
    region by region -> JSON {from (the first's sender), senders, hex, vllm, data} or an
    error."""
    deadline = time.monotonic() + seconds
    seen = []
    while time.monotonic() < deadline:
        take_push_notifs()
        for i, (sender, note) in enumerate(kv["notifs"]):
            try:
                parsed = parse_notif(note)
            except (ValueError, UnicodeDecodeError):
                continue
            if parsed.get("id") == req_id:
                del kv["notifs"][i]
                seen.append((sender, note, parsed))
                break
        if len(seen) == count:
            lens = kv["meta"].block_lens
            data = b"".join(
                buf[b * lens[r] : (b + 1) * lens[r]].tobytes()
                for r, buf in enumerate(kv["bufs"])
                for b in local
            )
            sender, note, parsed = seen[0]
            return {"from": sender, "senders": [x[0] for x in seen], "hex": note.hex(),
                    "vllm": parsed, "data": data.hex()}
        time.sleep(0.001)
    return {"error": "no WRITE notification", "seen": len(seen), "notifs": [n.hex() for _, n in kv["notifs"]]}


def kv_forge(port, local_hash, engine, msg):
    """A third agent, not the kv engine's: it handshakes with ENGINE's ROUTER at PORT (hash
    LOCAL_HASH checked) and sends its agent the notification MSG -> JSON {agent} or why
    not."""
    got = decode_agent(port, local_hash, True, engine)
    if isinstance(got, dict):
        return got
    agent, remote, _, _ = got
    agent.send_notif(remote, notif_msg=msg)
    heartbeat_agents.append(agent)
    return {"agent": agent.name if hasattr(agent, "name") else ""}


def main():
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "serve":
            hash_ = "" if args[0] == "-" else args[0]
            answer(serve(hash_, args[1], args[2] == "1", int(args[3])))
        elif cmd == "fetch":
            port, pp, tp = int(args[0]), int(args[1]), int(args[2])
            answer(json.dumps(fetch(port, pp, tp, args[3], args[4] == "1")))
        elif cmd == "raw":
            answer(json.dumps(raw(int(args[0]), bytes.fromhex(args[1]))))
        elif cmd == "idle":
            for _ in range(int(args[1])):
                sock = ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                # Closed by the server, it stays closed (no reconnect churn).
                sock.setsockopt(zmq.RECONNECT_IVL, -1)
                sock.connect(f"tcp://127.0.0.1:{args[0]}")
                idle_sockets.append(sock)
            answer("ok")
        elif cmd == "hash":
            answer(json.dumps(compat_hash(json.loads(bytes.fromhex(args[0])))))
        elif cmd == "notify_done":
            req_id = bytes.fromhex(args[0]).decode()
            answer(f"{req_id}:{int(args[1])}".encode().hex())
        elif cmd == "notify_hb":
            ids = [bytes.fromhex(x).decode() for x in args[0].split(",")]
            answer(("HB:" + ",".join(ids)).encode().hex())
        elif cmd == "parse_notif":
            try:
                answer(json.dumps(parse_notif(bytes.fromhex(args[0]))))
            except (ValueError, UnicodeDecodeError) as e:
                answer(json.dumps({"error": str(e)}))
        elif cmd == "kv_prefill":
            hash_ = "" if args[0] == "-" else args[0]
            nums = [int(x) for x in args[4:8]]
            groups = None
            if len(args) > 8 and args[8] != "-":
                groups = [int(x) for x in args[8].split(",")]
            ppl = int(args[9]) if len(args) > 9 else 1
            ssm = parse_ssm(args[10]) if len(args) > 10 else None
            answer(json.dumps(kv_prefill(hash_, args[1] == "1", args[2] == "1", args[3], *nums,
                                         groups, ppl, ssm)))
        elif cmd == "kv_finish":
            groups = [[int(x) for x in g.split(",") if x] for g in args[1].split(";")]
            window = 0 if len(args) < 3 else args[2] if args[2].startswith("ssm:") else int(args[2])
            tokens = int(args[3]) if len(args) > 3 else 0
            answer(json.dumps(kv_finish(bytes.fromhex(args[0]).decode(), groups, window, tokens)))
        elif cmd == "kv_keep":
            blocks = [int(x) for x in args[1].split(",")]
            got = kv_keep(bytes.fromhex(args[0]).decode(), blocks, int(args[2]), float(args[3]))
            answer(json.dumps(got))
        elif cmd == "kv_pull":
            params = json.loads(bytes.fromhex(args[0]))
            local = [] if args[2] == "-" else [int(x) for x in args[2].split(",")]
            turn2 = tuple(int(x) for x in args[3:6]) if len(args) > 3 else None
            answer(json.dumps(kv_pull(params, args[1], local, turn2)))
        elif cmd == "kv_reregister":
            answer(json.dumps(kv_reregister()))
        elif cmd == "kv_served":
            answer(kv["served"])
        elif cmd == "kv_load":
            params = json.loads(bytes.fromhex(args[0]))
            answer(json.dumps(kv_load(params, args[1], int(args[2]))))
        elif cmd == "kv_notifs":
            answer(json.dumps(kv_notifs(int(args[0]), float(args[1]))))
        elif cmd == "kv_decode":
            blocks = [int(x) for x in args[4].split(",")]
            req_id = bytes.fromhex(args[5]).decode()
            ssm = None
            if len(args) > 7:
                sizes, block = args[7].split(":")
                ssm = (parse_ssm(sizes), int(block))
            got = kv_decode(int(args[0]), args[1], args[2] == "1", args[3], blocks, req_id, int(args[6]), ssm)
            answer(json.dumps(got))
        elif cmd == "kv_heartbeat":
            got = kv_heartbeat(int(args[0]), args[1], args[2] == "1", args[3], int(args[4]), args[5])
            answer(json.dumps(got))
        elif cmd == "kv_dcp_prefill":
            nums = [int(x) for x in args[2:8]]
            answer(json.dumps(kv_dcp_prefill("" if args[0] == "-" else args[0], args[1], *nums)))
        elif cmd == "kv_dcp_notifs":
            answer(json.dumps(kv_dcp_notifs(int(args[0]), float(args[1]))))
        elif cmd == "kv_dcp_decode":
            params = json.loads(bytes.fromhex(args[0]))
            got = kv_dcp_decode(params, args[1], int(args[2]), int(args[3]), int(args[4]))
            answer(json.dumps(got))
        elif cmd == "kv_pp_prefill":
            nums = [int(x) for x in args[2:8]]
            answer(json.dumps(kv_pp_prefill("" if args[0] == "-" else args[0], args[1], *nums)))
        elif cmd == "kv_pp_finish":
            blocks = [int(x) for x in args[1].split(",")]
            answer(json.dumps(kv_pp_finish(bytes.fromhex(args[0]).decode(), blocks)))
        elif cmd == "kv_pp_decode":
            nums = [int(x) for x in args[3:6]]
            blocks = [int(x) for x in args[6].split(",")]
            req_id = bytes.fromhex(args[7]).decode()
            got = kv_pp_decode(int(args[0]), args[1], args[2], *nums, blocks, req_id, int(args[8]))
            answer(json.dumps(got))
        elif cmd == "kv_pp_push_finish":
            blocks = [int(x) for x in args[1].split(",")]
            answer(json.dumps(kv_pp_push_finish(bytes.fromhex(args[0]).decode(), blocks)))
        elif cmd == "kv_pp_push_write":
            answer(json.dumps(kv_pp_push_write(args[0], float(args[1]))))
        elif cmd == "kv_hma_pp_prefill":
            nums = [int(x) for x in args[2:7]]
            answer(json.dumps(kv_hma_pp_prefill(args[0], args[1], *nums)))
        elif cmd == "kv_hma_pp_push_finish":
            groups = [[int(x) for x in g.split(",")] for g in args[1].split(";")]
            answer(json.dumps(kv_hma_pp_push_finish(bytes.fromhex(args[0]).decode(), groups)))
        elif cmd == "kv_hma_pp_push_write":
            answer(json.dumps(kv_hma_pp_push_write(args[0], float(args[1]))))
        elif cmd == "kv_hma_decode":
            nums = [int(x) for x in args[2:6]]
            answer(json.dumps(kv_hma_decode(args[0], args[1], *nums)))
        elif cmd == "kv_hma_push_register":
            params = json.loads(bytes.fromhex(args[0]))
            groups = [[int(x) for x in g.split(",")] for g in args[3].split(";")]
            got = kv_hma_push_register(params, args[1], bytes.fromhex(args[2]).decode(), groups)
            answer(json.dumps(got))
        elif cmd == "kv_hma_push_wait":
            got = kv_hma_push_wait(bytes.fromhex(args[0]).decode(), int(args[1]), float(args[2]))
            answer(json.dumps(got))
        elif cmd == "kv_pp_notifs":
            answer(json.dumps(kv_pp_notifs(int(args[0]), float(args[1]))))
        elif cmd == "kv_push_finish":
            blocks = [int(x) for x in args[1].split(",")]
            tokens = int(args[2]) if len(args) > 2 else 0
            answer(json.dumps(kv_push_finish(bytes.fromhex(args[0]).decode(), blocks, tokens)))
        elif cmd == "kv_push_write":
            answer(json.dumps(kv_push_write(args[0], float(args[1]), float(args[2]))))
        elif cmd == "kv_push_register":
            params = json.loads(bytes.fromhex(args[0]))
            local = [int(x) for x in args[3].split(",")]
            got = kv_push_register(params, args[1], bytes.fromhex(args[2]).decode(), local, args[4])
            answer(json.dumps(got))
        elif cmd == "kv_push_hb":
            answer(kv_push_hb(args[0], [bytes.fromhex(x).decode() for x in args[1].split(",")]))
        elif cmd == "kv_push_wait":
            local = [int(x) for x in args[1].split(",")]
            count = int(args[3]) if len(args) > 3 else 1
            answer(json.dumps(kv_push_wait(bytes.fromhex(args[0]).decode(), local, float(args[2]), count)))
        elif cmd == "kv_forge":
            got = kv_forge(int(args[0]), args[1], args[2], bytes.fromhex(args[3]))
            answer(json.dumps(got))
        elif cmd == "quit":
            break


if __name__ == "__main__":
    main()
