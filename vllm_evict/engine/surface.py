"""The vLLM internals this plugin patches, wraps or overrides, with the parameters each was written for
(vLLM 0.26.0). `check(group)` runs before any hook of that group is installed and refuses, with one
message naming every difference, a vLLM whose patched symbols changed shape: the version pin alone
would not catch a rebuilt or patched wheel. docs/ENGINE.md lists the same surface.

A signature is compared by parameter names, kinds and which have defaults (`name=`, `*args`,
`**kwargs`): the things a wrapper or an override relies on. Annotations are not compared.
"""

from __future__ import annotations

import importlib
import inspect

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner."
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler."
_MANAGER = "vllm.v1.core.kv_cache_manager:KVCacheManager."
_SINGLE = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager."

SURFACE: dict[str, dict[str, str]] = {
    "engine": {
        # runner_hooks.py
        _RUNNER + "_update_states": "self, scheduler_output",
        _RUNNER + "_prepare_inputs": "self, scheduler_output, num_scheduled_tokens",
        _RUNNER + "_model_forward": "self, input_ids=, positions=, intermediate_tensors=, inputs_embeds=, **model_kwargs",
        _RUNNER + "execute_model": "self, scheduler_output, intermediate_tensors=",
        _RUNNER + "sample_tokens": "self, grammar_output",
        _RUNNER + "initialize_kv_cache": "self, kv_cache_config, is_profiling=",
        _RUNNER + "_build_attention_metadata": "self, num_tokens, num_reqs, max_query_len, num_tokens_padded=, "
                                               "num_reqs_padded=, ubatch_slices=, logits_indices=, use_spec_decode=, "
                                               "for_cudagraph_capture=, num_scheduled_tokens=, "
                                               "cascade_attn_prefix_lens=, slot_mappings=",
        _RUNNER + "_warmup_and_capture": "self, desc, cudagraph_runtime_mode, profile_seq_lens=, allow_microbatching=, "
                                         "num_warmups=, profiler=",
        # max_num_blocks is the 7th positional argument (worker.block_table_init doubles it)
        "vllm.v1.worker.block_table:MultiGroupBlockTable.__init__":
            "self, max_num_reqs, max_num_batched_tokens, pin_memory, device, block_sizes, kernel_block_sizes, "
            "max_num_blocks, cp_kv_cache_interleave_size=, slot_mapping_modes=",
        "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.dispatch":
            "self, num_tokens, uniform_decode=, has_lora=, num_active_loras=, valid_modes=, invalid_modes=",
        "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.initialize_cudagraph_keys":
            "self, cudagraph_mode, uniform_decode_query_len=",
        "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.add_cudagraph_key": "self, runtime_mode, batch_descriptor",
        "vllm.v1.worker.gpu_worker:kernel_warmup": "worker",
        # a draft model's later steps: the compacted rows' KV slots (runner_hooks.eagle_step)
        "vllm.v1.spec_decode.llm_base_proposer:eagle_step_update_slot_mapping_and_metadata":
            "positions_1d, block_table_tensor, seq_lens, block_size, max_model_len, out_clamped_positions, "
            "out_slot_mapping, input_batch_size=",
        # attention.py, cpu_backend.py, cuda_backend.py, triton_backend.py: metadata builders that add the step's
        # plan, and the KV write's metadata (vLLM calls do_kv_cache_update without it)
        "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build":
            "self, common_prefix_len, common_attn_metadata, fast_build=",
        "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder.build":
            "self, common_prefix_len, common_attn_metadata, fast_build=",
        "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadataBuilder.build":
            "self, common_prefix_len, common_attn_metadata, fast_build=",
        "vllm.model_executor.layers.attention.attention:get_attention_context": "layer_name",
        # triton_backend.py: the per-token-head cache's [data | fp32 scale] halves, and int4's rotation (called)
        "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend.get_kv_cache_shape":
            "num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=",
        "vllm.v1.attention.ops.int4_per_token_head:single_rht": "x, inverse=",
        # turboquant_backend.py: the builder (host lengths of compacted rows), the cache shape (V1 asks for
        # "auto"), the rotation and Lloyd-Max levels its decoding reads, and the store (called)
        "vllm.v1.attention.backends.turboquant_attn:TurboQuantMetadataBuilder.build":
            "self, common_prefix_len, common_attn_metadata, fast_build=",
        "vllm.v1.attention.backends.turboquant_attn:TurboQuantAttentionBackend.get_kv_cache_shape":
            "num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str=",
        "vllm.v1.attention.backends.turboquant_attn:_build_hadamard": "d, device_str",
        "vllm.model_executor.layers.quantization.turboquant.centroids:get_centroids": "d, bits",
        "vllm.v1.attention.ops.triton_turboquant_store:triton_turboquant_store":
            "key, value, kv_cache, slot_mapping, PiT, midpoints, mse_bits, key_packed_size, value_quant_bits, "
            "key_fp8=",
        # turboquant_backend.py: 4-bit decode rows through kernels/turboquant_decode.py, reduced by vLLM's stage 2
        # into the scratch buffers of vLLM's own decode
        "vllm.v1.attention.backends.turboquant_attn:TurboQuantAttentionImpl._decode_attention":
            "self, query, kv_cache, attn_metadata, Pi, centroids, PiT=, layer=",
        "vllm.v1.attention.ops.triton_decode_attention:_fwd_kernel_stage2":
            "Mid_O, o, lse, B_Seqlen, stride_mid_ob, stride_mid_oh, stride_mid_os, stride_obs, stride_oh, "
            "stride_lse_bs, NUM_KV_SPLITS, BLOCK_DV, Lv, OUTPUT_FP16=",
        "vllm.v1.worker.workspace:current_workspace_manager": "",
        "vllm.v1.worker.workspace:is_workspace_manager_initialized": "",
        # plugin.py: request validation in the API process
        "vllm.v1.engine.input_processor:InputProcessor._validate_params": "self, params, supported_tasks",
        "vllm.v1.engine.input_processor:InputProcessor.process_inputs":
            "self, request_id, prompt, params, supported_tasks, arrival_time=, lora_request=, tokenization_kwargs=, "
            "trace_headers=, priority=, data_parallel_rank=, resumable=",
        # scheduler.py: KV-cache-manager and scheduler subclasses
        _MANAGER + "get_computed_blocks": "self, request",
        _MANAGER + "allocate_slots": "self, request, num_new_tokens, num_new_computed_tokens=, new_computed_blocks=, "
                                     "num_lookahead_tokens=, num_external_computed_tokens=, delay_cache_blocks=, "
                                     "num_encoder_tokens=, full_sequence_must_fit=, reserved_blocks=, "
                                     "has_scheduled_reqs=",
        # scheduler.CompactedGroupManager: the evicted KV cache group's manager counts compacted requests physically
        _SINGLE + "get_num_blocks_to_allocate": "self, request_id, num_tokens, new_computed_blocks, "
                                                "total_computed_tokens, num_local_computed_tokens, "
                                                "num_tokens_main_model, apply_admission_cap=",
        _SINGLE + "allocate_new_blocks": "self, request_id, num_tokens, num_tokens_main_model",
        _SINGLE + "get_num_skipped_tokens": "self, num_computed_tokens",
        _SCHEDULER + "add_request": "self, request",
        _SCHEDULER + "_mamba_block_aligned_split":
            "self, request, num_new_tokens, num_new_local_computed_tokens=, num_external_computed_tokens=",
        _SCHEDULER + "_preempt_request": "self, request, timestamp",
        _SCHEDULER + "_update_after_schedule": "self, scheduler_output",
        _SCHEDULER + "update_from_output": "self, scheduler_output, model_runner_output",
        # called: a request whose eviction the engine cannot read ends with FINISHED_ERROR
        _SCHEDULER + "finish_requests": "self, request_ids, finished_status",
        # called: Ada-KV under tensor parallelism (compaction.KVHeadGroup, scheduler.kv_head_groups)
        "vllm.distributed:tensor_model_parallel_all_gather": "input_, dim=",
        "vllm.distributed:get_tensor_model_parallel_rank": "",
        "vllm.config:ModelConfig.get_total_num_kv_heads": "self",
        "vllm.config:ModelConfig.get_num_kv_heads": "self, parallel_config",
        # plugin.py: each engine's KV cache blocks, as the engine client adds them up (data parallelism)
        "vllm.v1.engine.core_client:MPClient._apply_ready_response": "self, payload",
        # plugin.py: the start-up check relaxed by VLLM_EVICT_ALLOW_LONG_PROMPTS
        "vllm.v1.core.kv_cache_utils:_check_enough_kv_cache_memory":
            "available_memory, get_needed_memory, max_model_len, estimate_max_model_len",
    },
    "serving": {  # serving.py: hooks into vLLM's OpenAI server (API process only)
        "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest.to_sampling_params":
            "self, max_tokens, default_sampling_params",
        "vllm.entrypoints.openai.completion.protocol:CompletionRequest.to_sampling_params":
            "self, max_tokens, default_sampling_params=",
        "vllm.v1.engine.output_processor:RequestState.make_request_output":
            "self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params=, ec_transfer_params=",
        "vllm.outputs:RequestOutput.add": "self, next_output, aggregate",
        # called by the handlers before a response starts: a request that never fits is refused there
        "vllm.v1.engine.async_llm:AsyncLLM.generate":
            "self, prompt, sampling_params, request_id, prompt_text=, lora_request=, tokenization_kwargs=, "
            "trace_headers=, priority=, data_parallel_rank=, reasoning_ended=, reasoning_parser_kwargs=",
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.create_chat_completion":
            "self, request, raw_request=",
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.create_completion":
            "self, request, raw_request=",
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator":
            "self, request, result_generator, request_id, model_name, conversation, tokenizer, request_metadata, "
            "parser=, mm_token_counts=",
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator":
            "self, request, result_generator, request_id, model_name, conversation, tokenizer, request_metadata, "
            "chat_template_kwargs=, mm_token_counts=",
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.request_output_to_completion_response":
            "self, final_res_batch, request, request_id, created_time, model_name, tokenizer, request_metadata",
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.completion_stream_generator":
            "self, request, engine_inputs, result_generator, request_id, created_time, model_name, num_prompts, "
            "tokenizer, request_metadata",
    },
}


def shape_of(obj) -> str:
    """Parameter names, kinds and defaults of a callable: 'self, a, b=, *args, **kwargs'."""
    parts = []
    kernel = getattr(obj, "fn", None)  # a Triton kernel (JITFunction): its Python function's parameters
    for p in inspect.signature(kernel if callable(kernel) else obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            parts.append("**" + p.name)
        else:
            parts.append(p.name + ("=" if p.default is not p.empty else ""))
    return ", ".join(parts)


def resolve(path: str):
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj


def check(group: str, surface: dict[str, dict[str, str]] = SURFACE) -> None:
    """Raise RuntimeError listing every symbol of `group` that is missing or has another shape."""
    problems = []
    for path, expected in surface[group].items():
        try:
            found = shape_of(resolve(path))
        except (ImportError, AttributeError) as exc:
            problems.append(f"  {path}: missing ({exc})")
            continue
        if found != expected:
            problems.append(f"  {path}:\n    expected ({expected})\n    found    ({found})")
    if problems:
        from vllm_evict._version_check import SUPPORTED_VLLM_VERSION

        raise RuntimeError(f"vllm-evict {group} hooks were written for vLLM {SUPPORTED_VLLM_VERSION}; this vLLM differs "
                           "where they patch it:\n" + "\n".join(problems))
