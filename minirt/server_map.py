"""The map from minirt to SGLang 0.5.23, vLLM 0.32.0 and SGLang's router 0.3.2, as data.

Each ``MapRow`` names a ``minirt`` object and, in the citation form that
``tools/check_citations.py`` resolves against the pinned releases, the SGLang and vLLM
files and symbols that do the same job, the flag or field that controls it, and what
the real engine does that minirt does not. ``chapter`` is the chapter that teaches the
minirt side; a later chapter adds its rows with ``MAP.extend([...])`` (or a tuple of
its own passed to ``check_map`` and ``markdown_table``), so the table grows as data and
the check covers it. ``BEYOND`` lists what the real engines do that minirt does not.

``check_map`` is the chapter's integrity check: every minirt name resolves, every
module a chapter introduced (``minirt.book.CHAPTER_MODULES``, notebook helpers aside)
has a row, and every row's SGLang and vLLM cells carry a citation or say "none".
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .book import CHAPTER_MODULES

__all__ = ["BEYOND", "HELPERS", "MAP", "MapRow", "check_map", "markdown_table", "resolve"]

# Modules that serve the notebooks, not a server: no row of their own.
HELPERS = frozenset({"book", "viz", "widgets", "checks", "errors", "simulate", "server_map",
                     "traffic", "hitcheck"})  # hitcheck: a tool run on a user's logs

_CITED = re.compile(r"(sglang-router|sglang|vllm) \d+\.\d+\.\d+ `[^`]+`")


@dataclass(frozen=True)
class MapRow:
    """One minirt name beside its counterparts (each a citation, or "none ...")."""

    minirt: str  # "module.Name[.attr]", resolved inside minirt
    sglang: str
    vllm: str
    flag: str
    adds: str  # what the real engine adds, "-" if nothing to say
    chapter: int


def _rows(chapter: int, *rows: tuple[str, str, str, str, str]) -> list[MapRow]:
    return [MapRow(*r, chapter=chapter) for r in rows]


MAP: list[MapRow] = [
    *_rows(
        0,
        ("model.load_model", "sglang 0.5.23 `srt/model_loader/loader.py: DefaultModelLoader`",
         "vllm 0.32.0 `model_executor/model_loader/default_loader.py: DefaultModelLoader`",
         "--model-path / --model", "tensor and pipeline parallelism, quantized weights"),
    ),
    *_rows(
        1,
        ("kv.prefill", "sglang 0.5.23 `srt/model_executor/model_runner.py: ModelRunner.forward` "
         "(an extend batch)",
         "vllm 0.32.0 `v1/worker/gpu_model_runner.py: GPUModelRunner.execute_model`", "-",
         "prefill and decode requests in one batch, one forward pass"),
    ),
    *_rows(
        2,
        ("workloads.standard_workloads",
         "sglang 0.5.23 `benchmark/datasets/generated_shared_prefix.py`",
         "vllm 0.32.0 `benchmarks/datasets/datasets.py` (vllm bench serve --dataset-name)",
         "--dataset-name (both)", "-"),
        ("radix.RadixNode",
         "sglang 0.5.23 `srt/mem_cache/unified_cache/unified_tree_core.py: UnifiedTreeNode` "
         "(last_access_time, hit_count; lock refs per component); "
         "sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey`",
         "no tree: vllm 0.32.0 `v1/core/kv_cache_utils.py: KVCacheBlock` (block_hash, ref_cnt)",
         "-", "SGLang keys a child by RadixKey.child_key_at (first token or first page)"),
        ("radix.RadixNode.split_at",
         "sglang 0.5.23 `srt/mem_cache/unified_cache/unified_tree_core.py: "
         "UnifiedTreeCore._split_node`",
         "none: blocks have a fixed size and never split", "--page-size", "-"),
    ),
    *_rows(
        3,
        ("radix.page_key", "sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.child_key_at`",
         "vllm 0.32.0 `v1/core/kv_cache_utils.py: hash_block_tokens` (one hash per full block)",
         "--page-size / --block-size", "-"),
        ("token_ids.TokenIds",
         "sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey` (a request's ids as an "
         "array, made per request by sglang 0.5.23 `srt/mem_cache/common.py: _req_radix_key`)",
         "vllm 0.32.0 `v1/request.py: Request.update_block_hashes` (a request's block hashes, "
         "computed once as its blocks fill)",
         "-", "-"),
        ("cache.RadixCache.match_prefix",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.match_prefix`; "
         "sglang 0.5.23 `srt/mem_cache/unified_cache/unified_tree_core.py: "
         "UnifiedTreeCore._match_prefix_helper, UnifiedTreeCore._match_post_processor`",
         "vllm 0.32.0 `v1/core/kv_cache_manager.py: KVCacheManager.get_computed_blocks`; "
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool.get_cached_block`",
         "--disable-radix-cache / --no-enable-prefix-caching", "-"),
        ("cache.RadixCache.insert_prefix",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.insert`",
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool.cache_full_blocks` (from "
         "KVCacheManager.cache_blocks)",
         "-", "SGLang also caches unfinished requests' K/V between chunks"),
    ),
    *_rows(
        4,
        ("cache.RadixCache.lock",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.inc_lock_ref`",
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool.touch` (ref_cnt += 1)", "-", "-"),
        ("cache.RadixCache.unlock",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.dec_lock_ref`",
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool.free_blocks` (tail first into the free "
         "queue)",
         "-", "-"),
        ("pool.KVPool",
         "sglang 0.5.23 `srt/mem_cache/memory_pool.py: MHATokenToKVPool`; "
         "sglang 0.5.23 `srt/mem_cache/allocator/paged.py: PagedTokenToKVPoolAllocator`",
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool` (free_block_queue); the GPU tensors in "
         "v1/worker/gpu_model_runner.py",
         "--mem-fraction-static, --max-total-tokens / --gpu-memory-utilization",
         "pool sized from free GPU memory after the weights; fp8 K/V (--kv-cache-dtype)"),
        ("pool.PageTable", "sglang 0.5.23 `srt/mem_cache/memory_pool.py: ReqToTokenPool`",
         "vllm 0.32.0 `v1/worker/block_table.py: BlockTable`", "-", "-"),
        ("forward.forward_paged",
         "sglang 0.5.23 `srt/layers/attention/flashinfer_backend.py` and the other backends there",
         "vllm 0.32.0 `v1/attention/backends/cpu_attn.py` and the other backends there",
         "--attention-backend (both)",
         "paged attention kernels read K/V in place; minirt gathers it into a dense tensor"),
        ("lifecycle.Lifecycle",
         "sglang 0.5.23 `srt/managers/schedule_batch.py: ScheduleBatch.prepare_for_extend`; "
         "sglang 0.5.23 `srt/mem_cache/allocation.py: alloc_for_extend`; "
         "sglang 0.5.23 `srt/mem_cache/common.py: release_kv_cache`",
         "vllm 0.32.0 `v1/core/kv_cache_manager.py: KVCacheManager.allocate_slots, KVCacheManager.free`",  # noqa: E501
         "-", "requests are retracted (preempted) when decode runs out of K/V slots"),
        ("cache.PrefixCache", "sglang 0.5.23 `srt/mem_cache/base_prefix_cache.py: BasePrefixCache`",
         "vllm 0.32.0 `v1/core/kv_cache_coordinator.py: KVCacheCoordinator`; "
         "vllm 0.32.0 `v1/core/single_type_kv_cache_manager.py: SingleTypeKVCacheManager`",
         "--radix-cache-backend",
         "caches for sliding-window and Mamba layers (hybrid models) behind one interface"),
    ),
    *_rows(
        5,
        ("cache.RadixCache.evict",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.evict`",
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool.get_new_blocks, "
         "BlockPool._maybe_evict_cached_block`",
         "--radix-eviction-policy", "-"),
        ("eviction.LRU", "sglang 0.5.23 `srt/mem_cache/evict_policy.py: LRUStrategy`",
         "vllm 0.32.0 `v1/core/kv_cache_utils.py: FreeKVCacheBlockQueue` (its only order)",
         "--radix-eviction-policy lru", "-"),
        ("eviction.LFU", "sglang 0.5.23 `srt/mem_cache/evict_policy.py: LFUStrategy`", "none",
         "--radix-eviction-policy lfu", "also slru and tlru (tail-optimized LRU)"),
        ("eviction.FIFO", "sglang 0.5.23 `srt/mem_cache/evict_policy.py: FIFOStrategy` (not a "
         "--radix-eviction-policy choice)", "none", "-", "-"),
        ("eviction.Priority",
         "sglang 0.5.23 `srt/mem_cache/evict_policy.py: PriorityStrategy`", "none",
         "--radix-eviction-policy priority", "-"),
        ("eviction.LeafHeap",
         "sglang 0.5.23 `srt/mem_cache/unified_cache/unified_tree_core.py: "
         "UnifiedTreeCore.evict_device_leaf` (a heap of evictable leaves; Python core)",
         "vllm 0.32.0 `v1/core/kv_cache_utils.py: FreeKVCacheBlockQueue` (doubly linked list, "
         "O(1))",
         "-", "-"),
        ("traces.load_trace",
         "sglang 0.5.23 `benchmark/datasets/mooncake.py: MooncakeDataset` (replays a Mooncake "
         "trace against a server)",
         "vllm 0.32.0 `benchmarks/datasets/datasets.py: TimedTrace` (hash ids of "
         "--timed-trace-chunk-hash-size tokens)",
         "--dataset-name (both)",
         "a server-side replay; minirt.traces feeds the caches directly, without a model"),
    ),
    *_rows(
        6,
        ("engine.Engine.step",
         "sglang 0.5.23 `srt/managers/scheduler.py: Scheduler.event_loop_normal, "
         "Scheduler.event_loop_overlap, Scheduler.get_next_batch_to_run`",
         "vllm 0.32.0 `v1/core/sched/scheduler.py: Scheduler.schedule, Scheduler.update_from_output`; "  # noqa: E501
         "vllm 0.32.0 `v1/engine/core.py: EngineCore.step`",
         "--disable-overlap-schedule / --async-scheduling",
         "overlap scheduling: the CPU schedules step n+1 while the GPU runs step n"),
        ("engine.Engine.generate",
         "sglang 0.5.23 `srt/managers/schedule_policy.py: PrefillAdder` (token budget per "
         "prefill batch)",
         "vllm 0.32.0 `v1/core/sched/scheduler.py: Scheduler.schedule` (token budget)",
         "--max-prefill-tokens, --chunked-prefill-size / --max-num-batched-tokens",
         "a cut prompt's chunks allocated (vLLM) or cached in the tree (SGLang) one at a "
         "time"),
        ("request.Request", "sglang 0.5.23 `srt/managers/io_struct.py: GenerateReqInput`",
         "vllm 0.32.0 `sampling_params.py: SamplingParams`", "-",
         "more sampling settings (vLLM's SamplingParams: top_p, min_p, presence_penalty, "
         "logprobs, n)"),
        ("chat.serve_chat",
         "sglang 0.5.23 `benchmark/serving.py: wrap_multi_turn_request_func` (each round "
         "resends the conversation so far, the answer appended)",
         "none: vllm bench serve sends a conversation's first turn (vllm 0.32.0 "
         "`benchmarks/datasets/datasets.py: ConversationDataset.sample`)", "-", "-"),
        ("serve.build_app", "sglang 0.5.23 `srt/entrypoints/http_server.py` (/generate, "
         "/v1/chat/completions)",
         "vllm 0.32.0 `entrypoints/openai/api_server.py`", "--host, --port (both)",
         "tokenizer and detokenizer in their own processes; streaming"),
        ("engine_worker.EngineWorker",
         "sglang 0.5.23 `srt/managers/tokenizer_manager.py: TokenizerManager` hands requests to "
         "sglang 0.5.23 `srt/managers/scheduler.py: Scheduler.event_loop_normal` in its own "
         "process; sglang 0.5.23 `srt/managers/detokenizer_manager.py: DetokenizerManager`",
         "vllm 0.32.0 `v1/engine/async_llm.py: AsyncLLM` hands requests to "
         "vllm 0.32.0 `v1/engine/core.py: EngineCoreProc.run_busy_loop` in its own process; "
         "vllm 0.32.0 `v1/engine/detokenizer.py: FastIncrementalDetokenizer`",
         "-", "processes and ZMQ sockets where minirt has threads and queues"),
        ("replay.replay", "sglang 0.5.23 `benchmark/serving.py` (python -m "
         "sglang.benchmark.serving)",
         "vllm 0.32.0 `benchmarks/serve.py` (vllm bench serve)", "--request-rate (both)", "-"),
        ("llama.llama_forward", "sglang 0.5.23 `srt/models/llama.py: LlamaForCausalLM.forward`",
         "vllm 0.32.0 `model_executor/models/llama.py: LlamaForCausalLM.forward`", "-",
         "a model file per architecture; minirt runs a Llama layer by layer and any other "
         "model through transformers' own forward"),
        ("attention.shared_prefix_attention",
         "sglang 0.5.23 `srt/layers/attention/merge_state.py: merge_state`",
         "vllm 0.32.0 `v1/attention/ops/merge_attn_states.py: merge_attn_states`", "-",
         "the merge of two attentions' outputs by their log-sum-exps as a GPU kernel"),
        ("working_set.WorkingKV",
         "none: the attention backends read running requests' K/V in the pool, through "
         "sglang 0.5.23 `srt/mem_cache/memory_pool.py: ReqToTokenPool`",
         "none: the attention backends read running requests' K/V in the pool, through "
         "vllm 0.32.0 `v1/worker/block_table.py: BlockTable`", "-",
         "paged kernels need no copy; minirt's decode reads a contiguous copy it keeps in "
         "step with the pool"),
        ("kernels.attention",
         "sglang 0.5.23 `srt/layers/attention/intel_amx_backend.py: IntelAMXAttnBackend` "
         "(sgl_kernel's extend_attention_cpu and decode_attention_cpu); "
         "sglang 0.5.23 `srt/layers/attention/torch_native_backend.py: TorchNativeAttnBackend` "
         "(torch's sdpa)",
         "vllm 0.32.0 `v1/attention/backends/cpu_attn.py: CPUAttentionBackendImpl.forward` "
         "(cpu_attention_with_kv_cache, one C++ kernel per instruction set: _get_attn_isa)",
         "--attention-backend intel_amx or torch_native (SGLang: "
         "sglang 0.5.23 `srt/layers/attention/attention_registry.py: create_intel_amx_backend, "
         "create_torch_native_backend`)",
         "paged K/V read in place, bf16 (AMX); minirt's is fp32 only, compiled on the "
         "reader's machine"),
        ("kernels.decode",
         "sglang 0.5.23 `srt/layers/attention/intel_amx_backend.py: "
         "IntelAMXAttnBackend.forward_decode` (sgl_kernel's decode_attention_cpu over each "
         "sequence's tokens in req_to_token, partial results for num_kv_splits = 8 parts)",
         "vllm 0.32.0 `v1/attention/backends/cpu_attn.py: CPUAttentionBackendImpl.forward` "
         "(the same cpu_attention_with_kv_cache over each request's blocks, scheduled with "
         "enable_kv_split from vllm 0.32.0 `envs.py: VLLM_CPU_ATTN_SPLIT_KV`, on by default)",
         "--attention-backend (both)",
         "both read a shared prefix once per request and can split a request's keys into "
         "parts; minirt reads it once per group, splitting a group's rows across threads"),
        ("kernels.rms_norm",
         "sglang 0.5.23 `srt/layers/layernorm.py: RMSNorm.forward_cpu` (sgl_kernel's "
         "fused_add_rmsnorm_cpu, the residual add and the norm in one, where the CPU has AMX; "
         "torch's operations otherwise)",
         "vllm 0.32.0 `model_executor/layers/layernorm.py: RMSNorm.forward_native` (torch's "
         "operations on a CPU: vllm 0.32.0 `platforms/interface.py: "
         "Platform.get_default_ir_op_priority` picks the native implementation, and vllm "
         "0.32.0 `kernels/vllm_c.py: rms_norm` is for GPUs)",
         "-", "bf16 (SGLang); minirt's kernels are fp32 only"),
        ("kernels.rope",
         "sglang 0.5.23 `srt/layers/rotary_embedding/base.py: RotaryEmbedding.forward_cpu` "
         "(sgl_kernel's rotary_embedding_cpu where the CPU has AMX)",
         "vllm 0.32.0 `model_executor/layers/rotary_embedding/base.py: "
         "RotaryEmbedding.forward_cpu` (vLLM's C++ rotary_embedding, in place)",
         "-", "a cos/sin cache indexed by position; minirt computes transformers' tables "
         "each pass"),
        ("kernels.gemv",
         "sglang 0.5.23 `srt/layers/quantization/unquant.py: UnquantizedLinearMethod.apply` "
         "(sgl_kernel's weight_packed_linear on weights packed at load, where the CPU has "
         "AMX; torch's F.linear otherwise), every row count alike",
         "vllm 0.32.0 `model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm` "
         "(in fp32, oneDNN's matmul on a handle made once per weight, every row count alike)",
         "-", "minirt runs one row on the plain weight with its own kernel and more rows "
         "on oneDNN's prepacked copy"),
        ("kernels.silu_mul",
         "sglang 0.5.23 `srt/layers/activation.py: SiluAndMul.forward_cpu` (sgl_kernel's "
         "silu_and_mul_cpu where the CPU has AMX)",
         "vllm 0.32.0 `model_executor/layers/activation.py: SiluAndMul.forward_cpu` (torch's "
         "operations on x86; vLLM's C++ kernel on POWER only)",
         "-", "-"),
    ),
    *_rows(
        7,
        ("scheduler.Scheduler.order",
         "sglang 0.5.23 `srt/managers/schedule_policy.py: SchedulePolicy.calc_priority, "
         "SchedulePolicy._sort_by_longest_prefix, SchedulePolicy._sort_by_dfs_weight`",
         "vllm 0.32.0 `v1/core/sched/request_queue.py: FCFSRequestQueue, PriorityRequestQueue`",
         "--schedule-policy / --scheduling-policy",
         "SGLang: fcfs (default), lpm, dfs-weight, lof, random, priority, routing-key, hrrn, "
         "shortest-prefill-first; vLLM: fcfs, priority (no prefix-aware order)"),
        ("scheduler.Scheduler.defers",
         "sglang 0.5.23 `srt/managers/schedule_policy.py: IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD, "
         "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, SchedulePolicy._compute_prefix_matches`",
         "none", "environment variables of the same names (SGLang)", "-"),
    ),
    *_rows(
        8,
        ("hashcache.HashCache",
         "sglang 0.5.23 `srt/mem_cache/utils.py: get_hash_str, compute_node_hash_values` (chained "
         "page hashes name pages in the storage tier and in KV events)",
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool`; "
         "vllm 0.32.0 `v1/core/kv_cache_utils.py: hash_block_tokens, resolve_none_hash_seed`",
         "--block-size, --prefix-caching-hash-algo (sha256, sha256_cbor, xxhash, xxhash_cbor)",
         "-"),
        ("cache.SaltedKey",
         "sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.child_key_at` ((extra_key, "
         "cache_salt) in every child key, as minirt)",
         "vllm 0.32.0 `v1/core/kv_cache_utils.py: generate_block_hash_extra_keys` (salt in the "
         "first block's extra keys; the chain carries it)",
         "request field cache_salt (both); SGLang also extra_key", "-"),
        ("sidechannel.timing_attack",
         "none (defence: sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.child_key_at`)",
         "none (defence: vllm 0.32.0 `v1/core/kv_cache_utils.py: generate_block_hash_extra_keys`)",
         "-", "-"),
    ),
    *_rows(
        9,
        ("tiers.HiRadixCache.load_back",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.load_back, "
         "UnifiedRadixCache.init_load_back`; "
         "sglang 0.5.23 `srt/managers/cache_controller.py: HiCacheController.load`",
         "vllm 0.32.0 `distributed/kv_transfer/kv_connector/v1/offloading_connector.py`; "
         "vllm 0.32.0 `v1/kv_offload/cpu/manager.py: CPUOffloadingManager.prepare_load`",
         "--enable-hierarchical-cache, --hicache-ratio, --hicache-size / --kv-offloading-size, "
         "--kv-offloading-backend (native, lmcache)",
         "copies on a side stream, layer by layer, overlapped with the forward pass; pinned "
         "host memory; a third tier in storage (--hicache-storage-backend)"),
        ("tiers.HiRadixCache.insert_prefix",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.evict` "
         "(write_back); "
         "sglang 0.5.23 `srt/managers/cache_controller.py: HiCacheController.write`",
         "vllm 0.32.0 `v1/kv_offload/cpu/manager.py: CPUOffloadingManager.prepare_store` (each "
         "computed block, unless store_threshold asks for repeats)",
         "--hicache-write-policy (write_back, write_through, write_through_selective)", "-"),
        ("tiers.HiRadixCache.evict_host",
         "sglang 0.5.23 `srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.evict_host`; "
         "sglang 0.5.23 `srt/mem_cache/pool_host/base.py: HostKVCache`",
         "vllm 0.32.0 `v1/kv_offload/cpu/policies/lru.py` and arc.py there", "-", "-"),
        ("router.CacheAwareRouter",
         "sglang-router 0.3.2 `src/policies/cache_aware.rs: CacheAwarePolicy`",
         "none in vLLM itself; "
         "vllm 0.32.0 `v1/engine/core_client.py: DPLBAsyncMPClient.get_core_engine_for_request` "
         "balances data-parallel engines by load",
         "--policy cache_aware, --cache-threshold, --balance-abs-threshold, "
         "--balance-rel-threshold, --max-tree-size (the router)",
         "routers fed by the engines' KV events (--kv-events-config, both) know what "
         "each replica really holds"),
        ("replicas.replay_replicas",
         "sglang-router 0.3.2 `src/sglang_router/launch_server.py: main` (one server process "
         "per data-parallel rank, each on its own port, behind the router)",
         "vllm 0.32.0 `v1/engine/core_client.py: DPLBAsyncMPClient` (data-parallel engines "
         "behind one API server)",
         "--dp-size (SGLang), --data-parallel-size (vLLM)",
         "replicas in their own processes or machines; minirt's share one model in one "
         "process and step in turn"),
        ("kv_events.ZmqEventPublisher",
         "sglang 0.5.23 `srt/disaggregation/kv_events.py: ZmqEventPublisher, KVEventBatch`",
         "vllm 0.32.0 `distributed/kv_events.py: ZmqEventPublisher, KVEventBatch, BlockStored, "
         "BlockRemoved, AllBlocksCleared`",
         "--kv-events-config (both; minirt.serve takes vLLM's JSON)",
         "a publisher thread with a bounded queue; one publisher per data-parallel rank"),
        ("kv_event_caches.EventRadixCache",
         "sglang 0.5.23 `srt/mem_cache/events.py: KVCacheEventRecorder` (SGLang's own "
         "namespaced block hashes, not vLLM's)",
         "vllm 0.32.0 `v1/core/block_pool.py: BlockPool.take_events`",
         "--kv-events-config",
         "events from the host and storage tiers too (minirt's host tier does not publish)"),
        ("precise_router.PreciseRouter",
         "none in sglang-router 0.3.2 (its cache_aware policy guesses from routed text)",
         "none in vLLM 0.32.0 itself (its events are for an external router)",
         "-", "production indexers (NVIDIA Dynamo's KV router, llm-d's precise prefix-cache "
         "scorer) read the same events; minirt's decides with 09a's balance rule and, as llm-d's "
         "speculative indexing does, credits the blocks it routed until their BlockStored"),
        ("router.ApproxTree", "sglang-router 0.3.2 `src/policies/tree.rs: Tree` (one per model, "
         "nodes annotated with tenants)", "none",
         "--max-tree-size, --eviction-interval-secs (60)",
         "the real tree is concurrent and is cut back on a timer"),
        ("router.RoundRobinRouter",
         "sglang-router 0.3.2 `src/policies/round_robin.rs: RoundRobinPolicy`",
         "none", "--policy round_robin", "-"),
        ("router.RandomRouter",
         "sglang-router 0.3.2 `src/policies/random.rs: RandomPolicy`", "none",
         "--policy random", "also power_of_two: the less loaded of two random replicas"),
        ("router.LeastLoadRouter", "none: not a --policy choice in the router 0.3.2",
         "vllm 0.32.0 `v1/engine/core_client.py: DPLBAsyncMPClient` (data-parallel engines)",
         "-", "-"),
        ("router.ConsistentHashRouter",
         "sglang-router 0.3.2 `src/policies/consistent_hashing.rs` (not a --policy choice in "
         "0.3.2; "
         "manual pins a routing key to a worker)", "none", "-",
         "prefix_hash (the Rust CLI's --policy only, sglang-router 0.3.2 `src/main.rs: CliArgs`): "
         "a hash of the first tokens instead of a session id"),
    ),
    *_rows(
        10,
        ("attention.aligned_attention",
         "sglang 0.5.23 `srt/batch_invariant_ops/batch_invariant_ops.py: "
         "enable_batch_invariant_mode`; a fixed split tile in sglang 0.5.23 "
         "`srt/layers/attention/triton_backend.py: TritonAttnBackend.__init__`",
         "vllm 0.32.0 `model_executor/determinism/batch_invariant.py: "
         "enable_batch_invariant_mode, init_batch_invariance`",
         "--enable-deterministic-inference (sglang 0.5.23 `srt/arg_groups/fields/exec_.py: "
         "ExecDeterministic.enable_deterministic_inference`) / VLLM_BATCH_INVARIANT=1",
         "batch-invariant GPU kernels (matmul, attention, reductions); minirt's deterministic "
         "mode is position-aligned chunks and padded GEMM rows on the CPU"),
    ),
    *_rows(
        11,
        ("hybrid.WindowRadixCache",
         "sglang 0.5.23 `srt/mem_cache/unified_cache/components/swa.py: SWAComponent, "
         "SWAComponent.create_match_validator, SWAComponent.evict_component`",
         "vllm 0.32.0 `v1/core/single_type_kv_cache_manager.py: SlidingWindowManager, "
         "SlidingWindowManager.find_longest_cache_hit`; vllm 0.32.0 "
         "`v1/core/kv_cache_coordinator.py: HybridKVCacheCoordinator`",
         "-", "one component (SGLang) or one manager per KV cache group (vLLM) per layer kind; "
         "page-sized window blocks; an every-layer-sliding cache, sglang 0.5.23 "
         "`srt/mem_cache/pure_swa_radix_cache.py: PureSWARadixCache`"),
        ("window_lifecycle.WindowLifecycle",
         "sglang 0.5.23 `srt/mem_cache/common.py: free_swa_out_of_window_slots`",
         "vllm 0.32.0 `v1/core/single_type_kv_cache_manager.py: "
         "SingleTypeKVCacheManager.remove_skipped_blocks`",
         "-", "the engine's lifecycle over two pools (Engine(cache='window')); window K/V "
         "a request owns freed as they leave its window, the tree's kept"),
        ("forward.forward_windowed",
         "sglang 0.5.23 `srt/mem_cache/swa_memory_pool.py: SWAKVPool, "
         "SWAKVPool.translate_loc_from_full_to_swa`",
         "vllm 0.32.0 `v1/worker/block_table.py: MultiGroupBlockTable`",
         "-", "a page table per pool (SGLang maps full slots to window slots; vLLM keeps one "
         "block table per KV cache group); attention kernels, not a padded gather"),
        ("state.StateCache",
         "sglang 0.5.23 `srt/mem_cache/unified_cache/components/mamba.py: MambaComponent, "
         "MambaComponent.create_match_validator`",
         "vllm 0.32.0 `v1/core/single_type_kv_cache_manager.py: MambaManager, "
         "MambaManager.find_longest_cache_hit`",
         "mamba cache mode (vllm 0.32.0 `config/cache.py: CacheConfig.mamba_cache_mode`)",
         "real state-space layers; vLLM's sub-block hits for Mamba hybrids"),
    ),
    *_rows(
        13,
        ("speculative.Speculator",
         "sglang 0.5.23 `srt/speculative/ngram_worker.py: NGRAMWorker` (n-gram drafts from a "
         "trie, verified as a tree)",
         "vllm 0.32.0 `v1/spec_decode/ngram_proposer.py: NgramProposer`; vllm 0.32.0 "
         "`v1/sample/rejection_sampler.py: RejectionSampler`",
         "--speculative-algorithm NGRAM, --speculative-num-draft-tokens (SGLang); "
         "--speculative-config with method ngram, num_speculative_tokens, prompt_lookup_min "
         "and prompt_lookup_max (vLLM)",
         "draft models (EAGLE, MTP, a smaller model), tree verification (SGLang), GPU "
         "kernels; minirt verifies one chain of prompt-lookup drafts"),
        ("draft_proposer.DraftModelProposer",
         "sglang 0.5.23 `srt/speculative/standalone_worker_v2.py: StandaloneWorkerV2, "
         "StandaloneDraftWorker`",
         "vllm 0.32.0 `v1/spec_decode/draft_model.py: DraftModelProposer`",
         "--speculative-algorithm STANDALONE, --speculative-draft-model-path (SGLang); "
         "--speculative-config with method draft_model and model (vLLM)",
         "a smaller draft model with its own paged KV cache; minirt's default draft is the "
         "target itself (a self-check), its K/V in a per-request transformers cache"),
        ("eagle_blocks.EagleBlockCache",
         "sglang 0.5.23 `srt/mem_cache/radix_cache.py: RadixKey.maybe_to_bigram_view` "
         "(an EAGLE tree keyed by token pairs)",
         "vllm 0.32.0 `v1/core/single_type_kv_cache_manager.py: "
         "FullAttentionManager.find_longest_cache_hit` (drop_eagle_block: the last matched "
         "block recomputed)",
         "on with an EAGLE or MTP drafter (both)",
         "real EAGLE heads reading the target's hidden states; minirt measures the lookup "
         "rules only (plain, drop, the lookahead key of vLLM RFC #50438)"),
    ),
]

# What the real engines do that minirt does not: (feature, SGLang flag, vLLM flag).
BEYOND: list[tuple[str, str, str]] = [
    ("overlap scheduling", "--disable-overlap-schedule", "--async-scheduling"),
    ("CUDA graphs for decode", "--cuda-graph-max-bs-decode, --disable-decode-cuda-graph",
     "--enforce-eager, compilation_config.cudagraph_mode"),
    ("paged attention kernels", "--attention-backend", "--attention-backend"),
    ("KV events to a router", "--kv-events-config", "--kv-events-config (BlockStored, "
     "BlockRemoved)"),
    ("prefill/decode disaggregation", "--disaggregation-mode prefill|decode, "
     "--disaggregation-transfer-backend", "--kv-transfer-config (e.g. NixlConnector)"),
]


def resolve(name: str):
    """``"cache.RadixCache.match_prefix"`` -> the object it names in minirt (AttributeError
    or ImportError if minirt has no such name)."""
    module, *attrs = name.split(".")
    obj = importlib.import_module(f"minirt.{module}")
    for attr in attrs:
        obj = getattr(obj, attr)
    return obj


def check_map(rows: Sequence[MapRow] = MAP, upto: int | None = None) -> set[str]:
    """Check ``rows``; return the modules they cover.

    Every minirt name resolves; every cell is a non-empty string; the SGLang and vLLM
    cells each hold a citation or begin with "none"/"no tree"; every module introduced
    by chapters up to ``upto`` (all of ``CHAPTER_MODULES`` if None), helpers aside, has a
    row. AssertionError naming the first row or module that fails.
    """
    for row in rows:
        cells = (row.minirt, row.sglang, row.vllm, row.flag, row.adds)
        assert all(isinstance(x, str) and x for x in cells), row
        resolve(row.minirt)
        for cell in (row.sglang, row.vllm):
            assert _CITED.search(cell) or cell.startswith(("none", "no tree")), (
                f"{row.minirt}: {cell!r} is neither a citation nor 'none'")
    introduced = {m for ch, mods in CHAPTER_MODULES.items()
                  if upto is None or ch <= upto for m in mods}
    covered = {row.minirt.split(".")[0] for row in rows}
    missing = sorted(introduced - HELPERS - covered)
    assert not missing, f"modules without a row: {missing}"
    return covered


def markdown_table(rows: Iterable[MapRow] = MAP) -> str:
    """The rows as one Markdown table (``|`` inside a cell escaped)."""
    head = ["minirt", "SGLang", "vLLM", "flag", "what the real engine adds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r.minirt}`", r.sglang, r.vllm, r.flag, r.adds]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
