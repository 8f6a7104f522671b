"""One settings object per service (environment prefix SPECSERVE_ROUTER_, SPECSERVE_DRAFT_,
SPECSERVE_TARGET_). The Helm chart's values map one to one onto these names (DESIGN §8)."""

from __future__ import annotations

import math

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Pools drafted inside the target's own process, on the engine's thread (no replica, no
# network hop on any round): by prompt lookup (ADR 0014, "n-gram beside the target"), by an
# EAGLE-style head from the target's own features (ADR 0020), by suffix decoding over the
# session and its class's outputs, shared by the fleet (ADR 0026), or by a draft model with the
# target's vocabulary, inside the target's round where the target runs the device step (ADR
# 0025). Each is its pool's only address.
LOCAL_NGRAM = "local:ngram"
LOCAL_EAGLE = "local:eagle"
LOCAL_SUFFIX = "local:suffix"
LOCAL_DRAFT = "local:draft"
LOCAL = (LOCAL_NGRAM, LOCAL_EAGLE, LOCAL_SUFFIX, LOCAL_DRAFT)


def pools_have_replicas(v: dict[str, list[str]]) -> dict[str, list[str]]:
    """draft_pools (router and target): every pool names at least one replica, or is one local
    drafter alone (`local:ngram`, `local:eagle`, `local:suffix`, `local:draft`)."""
    for name, addrs in v.items():
        if not addrs:
            raise ValueError(f"draft pool {name!r} has no replica addresses")
        if any(a.startswith("local:") for a in addrs) and not (len(addrs) == 1 and addrs[0] in LOCAL):
            raise ValueError(f"draft pool {name!r}: a local drafter ({', '.join(LOCAL)}: drafting inside the "
                             f"target) is a pool's only address; got {addrs}")
    return v


class WorkerSettings(BaseSettings):
    """What the draft and the target workers share: TLS and continuous batching."""

    # TLS (ADR 0011): a directory with tls.crt, tls.key and ca.crt (a cert-manager Secret);
    # empty = plaintext. Workers then require a client certificate signed by ca.crt (mTLS).
    tls_dir: str = ""
    # continuous batching (ADR 0013): queued calls run as one batch on the batched runner
    # (Llama/Qwen2/Qwen3; other architectures fall back to the per-session HF path)
    batching: bool = True
    # work items per batch; the target's engine: rows per step, i.e. the sessions decoding at
    # once, each seated until it ends (the others wait for a seat, ADR 0021)
    max_batch: int = Field(32, ge=1)
    kv_budget_mb: float = Field(256.0, gt=0)  # KV slots allocated at start (at most max_sessions)
    max_len: int = Field(0, ge=0)  # positions per KV slot; 0 = the model's context length
    prefill_chunk: int = Field(128, ge=1)  # long prompts are fed in chunks of this many tokens
    # where the batched runner's weights, KV slots and RoPE tables live (device.py):
    # auto = CUDA when torch sees one, else the CPU; dtype auto = bf16 on CUDA, fp32 on the CPU
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    dtype: str = Field("auto", pattern=r"^(auto|fp32|bf16|fp16)$")
    # on CUDA the KV budget is what this fraction of the device's memory leaves after the weights,
    # the CUDA context and a step's activations (like vLLM's setting of the same name); 0 = use
    # kv_budget_mb there too. The CPU always uses kv_budget_mb.
    gpu_memory_utilization: float = Field(0.9, ge=0, le=1)
    # invariant: every row's bits are the same in any batch (tiled GEMMs, ADR 0008), so greedy
    # output never depends on who shares a step; fast: one plain batched forward, cheaper for a
    # lone row (a 1-token decode row is not padded to a tile) but a row's logits may move in
    # the last bits with the batch, and greedy near-ties with them (ADR 0016)
    exact_batching: str = Field("invariant", pattern=r"^(invariant|fast)$")
    # ADR 0019: on CUDA, auto runs decode, verify and draft rows as fixed-shape steps replayed
    # from CUDA graphs (one per bucket of rows x tokens x key span; prefill chunks stay eager);
    # off keeps the eager forward (and, with exact_batching invariant, bitwise batch invariance
    # on the GPU too). The CPU runs eagerly either way.
    cuda_graphs: str = Field("auto", pattern=r"^(auto|off)$")
    # ADR 0019: with the graphs on, auto compiles each decoder layer whole, its KV scatter and
    # attention in (torch.compile to Triton, where torch finds Triton for the device): on an
    # H200 a 1.1B plain step's graph went from 773 kernels to 380 (ADR 0019's table); off: uncompiled
    cuda_compile: str = Field("auto", pattern=r"^(auto|off)$")


class DraftSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_DRAFT_", frozen=True)

    pool: str = "small"  # the pool name policies refer to
    # the draft's scheduler batches the calls of one instant (ADR 0013); the target's engine
    # loop builds its own steps and has neither setting
    max_wait_ms: float = Field(0.0, ge=0, le=1)  # wait this long for more calls (<= 1 ms)
    # work per draft batch, in the scheduler's tokens (a block counts its K draft steps, a bonus
    # guess 1): a batch stops at the first item that would pass it; its first item always goes
    max_batched_tokens: int = Field(2048, ge=1)
    kv_evict_idle_s: float = Field(1.0, ge=0)  # a session idle this long may lose its slot to a new one
    model: str = "ngram"  # "ngram", "eagle" (an EAGLE head, ADR 0020), or a Hugging Face model directory / hub id
    # model "eagle": the head's directory and its target's model directory (the replica reads the
    # target's embedding, final norm and LM head from it; the target sends the features)
    eagle_head: str = ""
    eagle_target: str = ""
    # a model directory whose tokenizer.json masks this replica's drafts under a constraint
    # (ADR 0017); empty = the model's own directory (an n-gram replica without one drafts free)
    tokenizer: str = ""
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port (written to port_file)
    port_file: str = ""  # where the bound port is written, for launchers
    metrics_port: int = Field(9090, ge=-1)  # Prometheus; 0 = a free port, -1 = off
    metrics_port_file: str = ""
    max_sessions: int = Field(256, ge=1)  # LRU of per-session KV caches
    # draft capacity (ADR 0021): a replica whose queue holds this many work items is saturated:
    # it refuses new sessions, and sheds those its drafts help least, to plain; 0 = unbounded
    max_queue: int = Field(128, ge=0)
    torch_threads: int = Field(1, ge=1)
    # q on the wire: the draft samples from its most likely tokens covering q_mass, at most
    # q_max_entries per position, and sends that q sparse (exact; ADR 0010). The in-process
    # engine uses the same defaults, so a seeded request drafts the same in both.
    q_mass: float = Field(0.999, gt=0, le=1)
    q_max_entries: int = Field(256, ge=0)  # 0 = no cap
    ngram_min: int = Field(1, ge=1)
    ngram_max: int = Field(4, ge=1)
    grace_s: float = Field(5.0, ge=0)  # SIGTERM drain
    # benchmarks/tests on CPU: extra time per proposed token, as a slower draft device would take
    simulated_token_ms: float = Field(0.0, ge=0)
    # a LoRA adapter (PEFT's format) merged into the draft model at load (ADR 0029): the pool of an
    # adapter's own drafter (its draft-side adapter); empty = the draft as it is
    lora: str = ""


class TargetSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_TARGET_", frozen=True)

    model: str = "models/specserve-demo-v1/target"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "specserve"
    name: str = "target-0"  # Ray actor name and registry entry
    namespace: str = "specserve"  # Ray namespace
    host: str = "127.0.0.1"  # address the actor's gRPC server binds and advertises
    port: int = 0
    metrics_port: int = Field(9090, ge=-1)  # Prometheus; 0 = a free port, -1 = off
    heartbeat_s: float = Field(1.0, gt=0)
    registry_ttl_s: float = Field(3.0, gt=0)
    max_sessions: int = Field(256, ge=1)
    torch_threads: int = Field(2, ge=1)
    num_gpus: float = Field(0.0, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # e.g. {"large_gpu": 1}
    max_restarts: int = Field(-1, ge=-1)  # -1 = restart forever
    grace_s: float = Field(5.0, ge=0)
    kv_budget_mb: float = Field(1024.0, gt=0)  # the target holds the long verify rows
    # benchmarks/tests on CPU: extra time per forward pass, flat in K, as a large target on a
    # GPU takes (memory-bound decode); 0 = off
    simulated_pass_ms: float = Field(0.0, ge=0)
    # and this much more per row in the step (a device whose step grows with the batch: the
    # capacity benchmark's H200 fit, bench/profiles.py: H200_STEP)
    simulated_row_ms: float = Field(0.0, ge=0)
    # The engine (ADR 0014): it drives its sessions' rounds. Pool name -> draft replica
    # addresses (one Draft.Link stream per replica); the router's pools by the same names.
    draft_pools: dict[str, list[str]] = Field(default_factory=dict)
    predraft_branches: int = Field(2, ge=0, le=8)  # likely outcomes a replica drafts ahead
    # the EAGLE-style head of a `local:eagle` pool (ADR 0020): its directory; empty = `eagle/`
    # beside the target's model directory (the demo pair ships one)
    eagle_head: str = ""
    # the draft model of a `local:draft` pool (ADR 0025): its directory, with the target's
    # tokenizer and vocabulary; empty = `draft/` beside the target's model directory (the demo
    # pair ships one). Inside the target's round where the target runs the device step, else
    # on the engine's thread
    local_draft_model: str = ""
    # remote pools whose replicas draft with that head (`model: eagle`): the target sends them
    # its features of the committed positions on the Link, ahead of each outcome
    eagle_pools: list[str] = Field(default_factory=list)
    # the longest a row waits for a late block, then runs plain (below it, the engine waits only
    # as long as the block is worth: E - 1 plain steps for a block expected to emit E tokens)
    block_wait_ms: float = Field(50.0, ge=0)
    # hold a step for blocks due within it when one fuller step emits more per second than
    # running the rows ready now (engine/scheduler.py: gather_wait; ADR 0014)
    gather_rows: bool = True
    # token trees (ADR 0020): a greedy session's block may have up to this many first
    # candidates, each with its chain, where the engine's cost model says the wider verify pays
    # (low load on a memory-bound device); 1 = chains (the default until trees are measured on a
    # GPU: on a CPU they rarely pay, and the engine's exploration of them costs draft work)
    tree_width: int = Field(1, ge=1, le=8)
    # ADR 0019, async steps: auto launches the next step of a step of greedy plain rows before
    # the engine has read it (fed its own picks on the device), so the engine's bookkeeping runs
    # while the device computes; on where the CUDA graphs are (on an H200: 2.43 -> 1.61 ms a
    # token at one session); off: each step launched once the one before is read
    async_steps: str = Field("auto", pattern=r"^(auto|off)$")
    max_batched_tokens: int = Field(2048, ge=1)  # tokens fed per engine step (verify rows + prefill chunks)
    redis_outage_s: float = Field(30.0, ge=0)  # commits ride a Redis outage this long
    # commit back-pressure: a session with this many rounds not yet committed (Redis slow or
    # down) waits for them before its next round; 0 = unbounded
    max_commit_lag: int = Field(16, ge=0)
    session_ttl_s: int = Field(3600, ge=1)  # as the router's: the sessions' keys live this long
    lease_s: float = Field(5.0, gt=0)  # the driver's lease, renewed every heartbeat_s
    detached_idle_s: float = Field(60.0, gt=0)  # a session nobody reads for this long is cancelled
    # the controller's statistics the engine feeds (the router reads them; ADR 0006)
    controller_half_life_s: float = Field(30.0, gt=0)
    stats_ttl_s: int = Field(7 * 86400, ge=60)
    # the name the draft replicas' certificates are checked against; empty = the address
    tls_server_name: str = ""
    # ADR 0030: the target split over this many ranks (a Ray placement group of as many bundles
    # of num_cpus/num_gpus/resources each, on one node), its heads, KV heads, MLP and LM head
    # sharded; it must divide the model's attention and KV heads. 1: one device
    tensor_parallel: int = Field(1)
    tp_placement_timeout_s: float = Field(60.0, gt=0)  # a group Ray cannot place by then is refused
    # LoRA adapters (ADR 0029): name -> a PEFT adapter directory, loaded at start (more, and
    # unloads, at run time through the router's AdapterAdmin); room for max_loras adapters of rank
    # up to max_lora_rank (0: no adapters; the room is allocated at start, as vLLM's max_loras)
    adapters: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(4, ge=0, le=64)
    max_lora_rank: int = Field(16, ge=1, le=256)

    @field_validator("tensor_parallel")
    @classmethod
    def _a_tensor_parallel_degree(cls, v: int) -> int:
        if v not in (1, 2, 4, 8):
            raise ValueError(f"tensor_parallel must be 1, 2, 4 or 8, got {v}")
        return v

    @field_validator("lease_s")
    @classmethod
    def _lease_outlives_heartbeats(cls, v: float, info) -> float:
        beat = info.data.get("heartbeat_s", 1.0)
        if v < 2 * beat:
            raise ValueError(f"lease_s ({v}) must be at least two heartbeats ({2 * beat})")
        return v

    @field_validator("draft_pools")
    @classmethod
    def _pools_have_replicas(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        return pools_have_replicas(v)

    @model_validator(mode="after")
    def _device_within_the_gpus_ray_gives(self) -> TargetSettings:
        """Ray shows an actor the GPUs it asked for (num_gpus), numbered from 0, and hides every
        GPU from one that asked for none: a `cuda` device must fit in that request."""
        if self.device.startswith("cuda"):
            index = int(self.device.partition(":")[2] or 0)
            if index >= math.ceil(self.num_gpus):
                raise ValueError(f"device {self.device!r} needs num_gpus > {index} (got {self.num_gpus}): Ray "
                                 "shows the target actor only the GPUs it asks for, as cuda:0 upwards")
        return self


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_ROUTER_", frozen=True)

    host: str = "127.0.0.1"
    port: int = 50051
    port_file: str = ""
    metrics_port: int = Field(9090, ge=-1)  # Prometheus; 0 = a free port, -1 = off
    metrics_port_file: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "specserve"
    tokenizer: str = "models/specserve-demo-v1/target"  # directory with tokenizer.json
    # pool name -> draft replica addresses, e.g. {"small": ["127.0.0.1:7001"], "ngram": [...]}
    draft_pools: dict[str, list[str]] = Field(default_factory=dict)
    default_pool: str = "small"
    default_k: int = Field(4, ge=0, le=32)
    max_tokens_limit: int = Field(1024, ge=1)
    max_prompt_tokens: int = Field(768, ge=1)
    target_wait_s: float = Field(30.0, ge=0)  # how long a round waits for a target to appear
    # a target with no KV room answers RESOURCE_EXHAUSTED: the round retries for this long,
    # then the request fails with RESOURCE_EXHAUSTED (ADR 0013)
    admission_wait_s: float = Field(10.0, ge=0)
    session_ttl_s: int = Field(3600, ge=1)
    grace_s: float = Field(10.0, ge=0)
    # the driver's lease (ADR 0014): a session whose target stops renewing it for lease_s is
    # re-placed by a router's reaper (every reap_s); the target's lease_s must be the same
    lease_s: float = Field(5.0, gt=0)
    reap_s: float = Field(2.0, gt=0)
    # TLS (ADR 0011): tls.crt/tls.key/ca.crt; clients get server TLS, workers are called with
    # this certificate as the client certificate (mTLS). Empty = plaintext.
    tls_dir: str = ""
    # the name workers' certificates are checked against (they are dialled by IP); empty = the address
    tls_server_name: str = ""
    # Redis down: commits and readers retry with backoff this long, then UNAVAILABLE
    redis_outage_s: float = Field(30.0, ge=0)
    # readers serve only what this many Redis replicas acknowledged (ADR 0023: a failover then
    # takes back nothing a client was served); None = 1 for a redis+sentinel:// or
    # redis+cluster:// URL (a replicated Redis), else 0.
    # After redis_replica_wait_s without them a read is served anyway (counted, alerted).
    redis_replica_acks: int | None = Field(None, ge=0)
    redis_replica_wait_s: float = Field(2.0, gt=0)

    @property
    def replica_acks(self) -> int:
        if self.redis_replica_acks is not None:
            return self.redis_replica_acks
        return 1 if self.redis_url.startswith(("redis+sentinel://", "redis+cluster://")) else 0
    # every gRPC server: the largest request accepted, and RPCs in flight before
    # RESOURCE_EXHAUSTED (streams count while open)
    max_message_bytes: int = Field(4 << 20, ge=1024)
    max_concurrent_rpcs: int = Field(2048, ge=1)
    # PolicyAdmin: one token ("admin"), or named tokens {"alice": "..."}; the name is the
    # audit log's "who". No token configured = policy administration is refused.
    admin_token: SecretStr = SecretStr("")
    admin_tokens: dict[str, SecretStr] = Field(default_factory=dict)
    # policies created at start when their class has none yet (a stored policy always wins)
    policies: dict[str, dict] = Field(default_factory=dict)
    policy_reload_s: float = Field(5.0, gt=0)  # full reload besides pub/sub
    # the controller (ADR 0006)
    controller_half_life_s: float = Field(30.0, gt=0)
    controller_refresh_s: float = Field(0.5, gt=0)
    controller_min_rounds: float = Field(8.0, ge=0)
    stats_ttl_s: int = Field(7 * 86400, ge=60)
    # classifier rules [{"workload_class", "pattern", "weight", "name"}]; null = built-in rules
    classifier_rules: list[dict] | None = None
    classifier_fallback: str = "chat"
    # the OpenAI-compatible HTTP API (ADR 0012): its port (0 = a free one, -1 = off), the model
    # id it serves, and the API keys it accepts (none configured = no key asked for)
    http_port: int = Field(8000, ge=-1, le=65535)
    http_port_file: str = ""
    model_name: str = "specserve"
    api_keys: list[SecretStr] = Field(default_factory=list)
    http_max_in_flight: int = Field(256, ge=1)  # HTTP requests served at once; beyond: 429

    @field_validator("draft_pools")
    @classmethod
    def _pools_have_replicas(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        return pools_have_replicas(v)
