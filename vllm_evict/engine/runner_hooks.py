"""The model-runner hooks (the CPU runner inherits them from `GPUModelRunner`):
- `initialize_kv_cache`: the KV cache group eviction compacts, before vLLM builds its metadata builders;
- `_update_states`: drop state of finished/resumed requests; after a compaction step, strip the
  prompt blocks from the request's block-table row (the scheduler already freed them);
- `_prepare_inputs`: build the StepPlan for this batch (row order is final here) and shift the
  compacted rows' attention lengths and KV slots;
- `_build_attention_metadata`: the plan is what the metadata builders read while vLLM builds the step's
  metadata (step.BUILD); on a hybrid model the drafter's metadata gets the compacted rows' physical lengths;
- `_model_forward`: after the forward, compact the requests that reached their eviction point, all
  layers at once (compaction.compact_requests);
- `execute_model`, `sample_tokens`: reports on the step's output; the plan is cleared when the step ends;
  with a draft model that has KV layers of its own, the step's compaction waits until its drafts are
  proposed (the drafter writes this step's tokens first), and the drafter's later steps address the
  compacted rows' KV at their shifted positions (`eagle_step_update_slot_mapping_and_metadata`);
- `MultiGroupBlockTable.__init__`: the evicted group's rows widened for the fresh blocks;
and the CUDA-graph dispatcher: uniform decode steps with per-head (Ada-KV) rows replay FULL graphs of
their own, keyed by `PerHeadDecodeBatch`; those without per-head rows that record window queries or
compact replay vLLM's attention in FULL graphs that also stage every layer's queries, keyed by
`StagedDecodeBatch`; both are captured next to vLLM's decode graphs. Other steps that need the attention
call (eager per-head tables) skip FULL graphs.
"""

from __future__ import annotations

import dataclasses

from vllm_evict.engine.host_gc import relax_full_collections
from vllm_evict.engine.layout import per_head_attention
from vllm_evict.engine.step import BUILD, PerHeadDecodeBatch, StagedDecodeBatch
from vllm_evict.engine.warm_up import warm_up_scoring
from vllm_evict.engine.worker import STATE


def install_runner_hooks() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.spec_decode import llm_base_proposer
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_vllm_evict_hooked", False):
        return

    orig_update = GPUModelRunner._update_states
    orig_prepare = GPUModelRunner._prepare_inputs
    orig_execute = GPUModelRunner.execute_model
    orig_model_forward = GPUModelRunner._model_forward
    orig_sample = GPUModelRunner.sample_tokens
    orig_block_table_init = MultiGroupBlockTable.__init__
    orig_dispatch = CudagraphDispatcher.dispatch
    orig_init_keys = CudagraphDispatcher.initialize_cudagraph_keys
    orig_warmup_and_capture = GPUModelRunner._warmup_and_capture
    orig_kernel_warmup = gpu_worker.kernel_warmup
    orig_initialize_kv_cache = GPUModelRunner.initialize_kv_cache
    orig_build_metadata = GPUModelRunner._build_attention_metadata
    orig_eagle_step = llm_base_proposer.eagle_step_update_slot_mapping_and_metadata

    def eagle_step(positions_1d, block_table_tensor, seq_lens, block_size, max_model_len, out_clamped_positions,
                   out_slot_mapping, input_batch_size=None):
        # a compacted row's KV sits at its position less its shift; RoPE keeps the position itself
        shift = STATE.draft_shift(positions_1d.shape[0])
        if shift is None:
            return orig_eagle_step(positions_1d, block_table_tensor, seq_lens, block_size, max_model_len,
                                   out_clamped_positions, out_slot_mapping, input_batch_size)
        orig_eagle_step(positions_1d - shift, block_table_tensor, seq_lens, block_size, max_model_len,
                        out_clamped_positions, out_slot_mapping, input_batch_size)
        out_clamped_positions[: positions_1d.shape[0]] += shift.to(out_clamped_positions.dtype)

    def _build_attention_metadata(self, *args, **kwargs):
        BUILD.plan = STATE.plan  # what the evicted group's metadata builder puts on its metadata
        try:
            attn_metadata, draft_metadata = orig_build_metadata(self, *args, **kwargs)
        finally:
            BUILD.plan = None
        return attn_metadata, STATE.draft_lengths(draft_metadata)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        relax_full_collections()  # a worker's process holds the runner's per-request token lists
        STATE.set_kv_cache_groups(self, kv_cache_config)
        return orig_initialize_kv_cache(self, kv_cache_config, *args, **kwargs)

    def _update_states(self, scheduler_output):
        STATE.before_update_states(self, scheduler_output)
        return orig_update(self, scheduler_output)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        result = orig_prepare(self, scheduler_output, *args, **kwargs)
        STATE.build_plan(self, scheduler_output)
        return result

    def _model_forward(self, *args, **kwargs):
        output = orig_model_forward(self, *args, **kwargs)
        STATE.after_forward(self)
        return output

    def execute_model(self, *args, **kwargs):
        try:
            output = orig_execute(self, *args, **kwargs)
            if output is not None:  # no sample_tokens follows this step
                STATE.after_drafts(self)
            return STATE.attach_report(output)
        finally:
            STATE.end_step()

    def sample_tokens(self, *args, **kwargs):
        output = orig_sample(self, *args, **kwargs)
        STATE.after_drafts(self)
        return STATE.attach_report(output)

    def block_table_init(self, *args, **kwargs):
        # During the compaction step a row of the evicted group holds the prompt blocks plus the P fresh ones.
        # Only that group's rows widen: a linear-attention group reads its state index off column 0 and
        # needs rows of its own width. (Before the KV cache groups are known, every group: one group then.)
        group = STATE.group

        def widened(widths):
            return [2 * n if group is None or i == group.index else n for i, n in enumerate(widths)]

        if "max_num_blocks" in kwargs:
            kwargs["max_num_blocks"] = widened(kwargs["max_num_blocks"])
        else:
            args = list(args)
            args[6] = widened(args[6])
        orig_block_table_init(self, *args, **kwargs)

    def dispatch(self, *args, invalid_modes=None, **kwargs):
        # Where vLLM picked a FULL decode graph: a step with per-head rows replays a per-head graph (the split
        # or unsplit one as the plan chose, else the one this size has), a step that records window queries or
        # compacts without them a staged graph; without such a graph it runs PIECEWISE or eager (the attention
        # call does the work). Every other step keeps vLLM's choice.
        plan, capturing = STATE.plan, STATE.capturing
        mode, desc = orig_dispatch(self, *args, invalid_modes=invalid_modes, **kwargs)
        if mode != CUDAGraphMode.FULL:
            return mode, desc
        if isinstance(capturing, PerHeadDecodeBatch) or (capturing is None and plan is not None and plan.per_head):
            split = capturing.split_kv if capturing is not None else plan.split_kv
            choices = [PerHeadDecodeBatch(**dataclasses.asdict(desc), split_kv=s) for s in (split, not split)]
        elif isinstance(capturing, StagedDecodeBatch) or (capturing is None and plan is not None
                                                          and plan.stages_queries):
            choices = [StagedDecodeBatch(**dataclasses.asdict(desc))]
        else:
            return mode, desc
        for choice in choices:
            if choice in self.cudagraph_keys[CUDAGraphMode.FULL]:
                return mode, choice
        invalid_modes = set(invalid_modes or ()) | {CUDAGraphMode.FULL}
        return orig_dispatch(self, *args, invalid_modes=invalid_modes, **kwargs)

    def initialize_cudagraph_keys(self, *args, **kwargs):
        from vllm_evict.engine.per_head import MAX_SPLIT_SEQUENCES

        orig_init_keys(self, *args, **kwargs)
        num_heads = self.vllm_config.model_config.get_num_kv_heads(self.vllm_config.parallel_config)
        per_head = per_head_attention(self.vllm_config)  # else no request is ever in per-head layout
        for desc in list(self.cudagraph_keys[CUDAGraphMode.FULL]):
            if desc.uniform and self.uniform_decode_query_len == 1:  # one token per row (per_head.py)
                fields = dataclasses.asdict(desc)
                self.add_cudagraph_key(CUDAGraphMode.FULL, StagedDecodeBatch(**fields))
                if not per_head:
                    continue
                self.add_cudagraph_key(CUDAGraphMode.FULL, PerHeadDecodeBatch(**fields))
                if desc.num_tokens * num_heads <= MAX_SPLIT_SEQUENCES:
                    self.add_cudagraph_key(CUDAGraphMode.FULL, PerHeadDecodeBatch(**fields, split_kv=True))

    def _warmup_and_capture(self, desc, *args, **kwargs):
        STATE.capturing = desc if isinstance(desc, (PerHeadDecodeBatch, StagedDecodeBatch)) else None
        try:
            return orig_warmup_and_capture(self, desc, *args, **kwargs)
        finally:
            STATE.capturing = None

    def kernel_warmup(worker):
        orig_kernel_warmup(worker)
        STATE.size_batches(worker)
        warm_up_scoring(worker.model_runner)

    GPUModelRunner._update_states = _update_states
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner.sample_tokens = sample_tokens
    MultiGroupBlockTable.__init__ = block_table_init
    CudagraphDispatcher.dispatch = dispatch
    llm_base_proposer.eagle_step_update_slot_mapping_and_metadata = eagle_step
    CudagraphDispatcher.initialize_cudagraph_keys = initialize_cudagraph_keys
    GPUModelRunner._warmup_and_capture = _warmup_and_capture
    gpu_worker.kernel_warmup = kernel_warmup
    GPUModelRunner._vllm_evict_hooked = True
