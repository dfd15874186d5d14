"""Independent reference for engine exactness tests: a plain torch decoder loop over an HF Llama/Qwen2
checkpoint that evicts with the engine-free policy code and decodes over kept tokens only.

No vLLM code is involved: attention is explicit softmax over per-head key lists, RoPE comes from the
HF model, positions stay the original ones (kept keys are not re-rotated; new tokens continue at n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_evict.policies import EvictionConfig, score_tokens, select_tokens


@dataclass
class ReferenceResult:
    token_ids: list[int]
    logprobs: list[float]          # log-softmax of the chosen token at each step
    top5: list[list[int]]          # the 5 most likely tokens at each step
    kept_per_layer: list[list[int]]  # kept tokens per KV head, per layer
    near_ties: int = 0             # replay: kept boundaries within DESIGN.md §7.3's tolerance of the next score


class ReferenceDecoder:
    def __init__(self, model_dir, dtype=torch.float32, device="cpu"):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        cfg = self.model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5

    def _rope(self, q, k, positions):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.model.model.rotary_emb(q, positions.unsqueeze(0))
        # q, k: [T, H, D] -> HF layout [1, H, T, D]
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1)

    def _layer_qkv(self, layer, hidden, positions):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        T = x.shape[0]
        q = attn.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = self._rope(q, k, positions)
        return q, k, v

    def _finish_layer(self, layer, hidden, attn_out):
        hidden = hidden + layer.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _attend(self, q, keys, values, causal_offset: int | list[int] | None):
        """q [T, Hq, D]; keys/values per KV head: lists of [L_h, D]. With causal_offset, query t sees
        the first causal_offset + t + 1 keys of every head (prefill; a list: per head); else all keys (decode)."""
        g = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        for h in range(self.num_kv_heads):
            qh = q[:, h * g: (h + 1) * g]                          # [T, g, D]
            logits = torch.einsum("tgd,ld->tgl", qh, keys[h]) * self.scale
            if causal_offset is not None:
                T, L = q.shape[0], keys[h].shape[0]
                offset = causal_offset[h] if isinstance(causal_offset, list) else causal_offset
                mask = torch.arange(L, device=q.device)[None, :] > (offset + torch.arange(T, device=q.device))[:, None]
                logits = logits.masked_fill(mask[:, None, :], float("-inf"))
            out[:, h * g: (h + 1) * g] = torch.einsum("tgl,ld->tgd", logits.softmax(-1), values[h])
        return out

    @torch.no_grad()
    def prefill(self, prefix_ids: list[int]):
        """Full causal attention over the prefix: per layer (q, k, v) post-RoPE, and the last hidden state."""
        model = self.model.model
        positions = torch.arange(len(prefix_ids), device=self.device)
        hidden = model.embed_tokens(torch.tensor(prefix_ids, device=self.device))
        per_layer = []
        for layer in model.layers:
            q, k, v = self._layer_qkv(layer, hidden, positions)
            keys = [k[:, h] for h in range(self.num_kv_heads)]
            values = [v[:, h] for h in range(self.num_kv_heads)]
            hidden = self._finish_layer(layer, hidden, self._attend(q, keys, values, causal_offset=0))
            per_layer.append((q, k, v))
        return per_layer, hidden[-1:]

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_tokens: int, config: EvictionConfig | None = None,
                 evict_at: int | None = None, page_size: int = 16, prefill=None,
                 keep_override: list[torch.Tensor] | None = None) -> ReferenceResult:
        """Greedy tokens when the KV of prompt_ids[:evict_at] (default: the whole prompt) is evicted with
        `config` at the end of its prefill. `prefill` = self.prefill(prompt_ids[:E]) may be passed to reuse it.
        `keep_override` (per layer [H, E] bool) replaces the reference's own selection (GPU checks feed the
        engine's kept sets to isolate compaction + attention from bf16 scoring near-ties)."""
        n = len(prompt_ids)
        E = n if evict_at is None else min(evict_at, n)
        per_layer, last_hidden = prefill if prefill is not None else self.prefill(prompt_ids[:E])
        kv = []
        kept_per_layer = []
        for layer_idx, (q, k, v) in enumerate(per_layer):
            keep = None
            if keep_override is not None:
                keep = keep_override[layer_idx].to(k.device)
            elif config is not None and config.num_pages(E, page_size) is not None:
                w = config.window_size()
                scores = score_tokens(config.policy, q[E - w:] if w else q[:0], k, v, scale=self.scale,
                                      context=self._context(layer_idx, torch.arange(E).expand(self.num_kv_heads, E),
                                                            0, config),
                                      **config.score_options())
                keep = select_tokens(scores, config.budget, page_size=page_size, **config.select_options())
            keys = [k[:, h] if keep is None else k[keep[h], h] for h in range(self.num_kv_heads)]
            values = [v[:, h] if keep is None else v[keep[h], h] for h in range(self.num_kv_heads)]
            kv.append((keys, values))
            kept_per_layer.append([kh.shape[0] for kh in keys])
        return self._decode(kv, last_hidden, list(prompt_ids[E:]), E, max_tokens, kept_per_layer)

    @torch.no_grad()
    def replay(self, prompt_ids: list[int], max_tokens: int, spec, page_size: int = 16) -> ReferenceResult:
        """Greedy tokens of a request that compacts at DESIGN.md §4.8's points (`spec`: request_config.RequestEviction;
        under Ada-KV each head holds its own number of tokens after a point): its prompt eviction (one-shot at E, or block-wise in chunks of C tokens: each
        chunk attends to what its layer holds plus itself, and every chunk end past P pages compacts), then
        a decode point after the forward that writes each C_d-th generated token's K/V. At a point each head
        scores what it holds (under protect_prompt only its generated tokens) with the window queries of
        the last w of them, kept from when they were processed, and keeps its best P (P_d) pages.
        kept_per_layer: what each head holds at the end."""
        model, config = self.model.model, spec.config
        self._near_ties = 0
        n = len(prompt_ids)
        E = spec.eviction_point(n)
        pages = config.num_pages(E, page_size)
        chunk = spec.chunk_tokens(page_size) if pages else 0
        decode_every = spec.decode_tokens(page_size)
        H = self.num_kv_heads
        empty = torch.empty(0, self.head_dim, device=self.device)
        # per layer: per head keys, values and original positions; the query of every position seen
        kv = [([empty] * H, [empty] * H) for _ in model.layers]
        positions = [[torch.empty(0, dtype=torch.int64)] * H for _ in model.layers]
        queries = [{} for _ in model.layers]
        points = 0

        def forward(ids: list[int], start: int, point: str | None):
            """One forward of tokens ids at positions start.. (causal over what each layer holds), then
            the compaction `point` ("prompt" / "decode") of every layer; the last hidden state."""
            nonlocal points
            hidden = model.embed_tokens(torch.tensor(ids, device=self.device))
            pos = torch.arange(start, start + len(ids), device=self.device)
            for index, (layer, (keys, values)) in enumerate(zip(model.layers, kv)):
                q, k, v = self._layer_qkv(layer, hidden, pos)
                held = [kh.shape[0] for kh in keys]  # each head's (Ada-KV: uneven)
                for t, p in enumerate(pos.tolist()):
                    queries[index][p] = q[t]
                keys[:] = [torch.cat([keys[h], k[:, h]]) for h in range(H)]
                values[:] = [torch.cat([values[h], v[:, h]]) for h in range(H)]
                positions[index][:] = [torch.cat([positions[index][h], pos.cpu()]) for h in range(H)]
                hidden = self._finish_layer(layer, hidden, self._attend(q, keys, values, causal_offset=held))
                if point is not None:
                    self._compact(index, keys, values, positions[index], queries[index], spec, point, points,
                                  pages, n, page_size)
            if point is not None:
                points += 1
            return hidden[-1:]

        if pages is None:  # no prompt eviction: prefill, then the decode points
            last_hidden, done = forward(prompt_ids, 0, None), n
        elif chunk:
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                over = end > pages * page_size  # every chunk end past P pages (DESIGN.md §4.3)
                last_hidden = forward(prompt_ids[start:end], start, "prompt" if over else None)
            done = n
        else:
            last_hidden, done = forward(prompt_ids[:E], 0, "prompt"), E
        tokens, logprobs, top5 = [], [], []
        pending = list(prompt_ids[done:])
        while len(tokens) < max_tokens:
            if not pending:
                tok = self._greedy(last_hidden, tokens, logprobs, top5)
                pending = [tok]
                if len(tokens) == max_tokens:
                    break
            written = done + 1 - n  # generated tokens whose K/V this forward writes
            point = "decode" if decode_every and written > 0 and written % decode_every == 0 else None
            last_hidden = forward([pending.pop(0)], done, point)
            done += 1
        kept_per_layer = [[kh.shape[0] for kh in keys] for keys, _ in kv]
        return ReferenceResult(tokens, logprobs, top5, kept_per_layer, self._near_ties)

    def _context(self, layer: int, positions: torch.Tensor, index: int, config):
        """Where a layer's scored tokens sit (DESIGN.md §4.8 e): original positions [H, n], heads 0..H_kv-1,
        compaction index, the request's seed."""
        from vllm_evict.policies.random import TokenContext

        H = self.num_kv_heads
        return TokenContext(positions=positions, heads=torch.arange(H), layers=torch.full((H,), layer),
                            compaction=index, seed=config.seed or 0)

    def _compact(self, layer: int, keys: list, values: list, positions: list, queries: dict, spec, point: str,
                 index: int, pages: int | None, n: int, page_size: int) -> None:
        """Compaction point `index` of one layer (DESIGN.md §4.8 a): each head keeps its best pages of its candidates
        (under Ada-KV the heads may hold different counts: scored padded to the longest, with their lengths)."""
        config = spec.config
        H = self.num_kv_heads
        counts = [p.shape[0] for p in positions]
        fixed = 0
        if point == "decode" and spec.protect_prompt:
            prompt_held = {int((p < n).sum()) for p in positions}
            assert len(prompt_held) == 1  # every head holds as many prompt tokens (request_config refuses others)
            fixed = prompt_held.pop()
        longest = max(counts)

        def padded(per_head: list) -> torch.Tensor:  # [longest, H, ...], zero past a head's count
            return torch.stack([F.pad(x, (0, 0) * (x.dim() - 1) + (0, longest - x.shape[0])) for x in per_head], dim=1)

        k_all, v_all, held = padded(keys), padded(values), padded(positions).T       # held: [H, longest]
        lengths = None if len(set(counts)) == 1 else torch.tensor(counts) - fixed
        cand = held[:, fixed:]
        m = counts[0] - fixed
        w = min(config.window_size(), m if lengths is None else int(lengths.min()))
        window_positions = cand[0, m - w: m].tolist()  # the last w held: the same tokens in every head
        q_window = torch.stack([queries[p] for p in window_positions]) if w else None
        sink = int((cand[0, :m] < config.sink_size()).sum())
        context = self._context(layer, cand, index, config)
        scores = score_tokens(config.policy, q_window, k_all[fixed:], v_all[fixed:], scale=self.scale,
                              **{**config.score_options(), "window": w, "sink": sink}, context=context,
                              lengths=None if lengths is None else lengths.to(k_all.device))
        if point == "decode":
            budget = spec.decode_budget
        else:
            budget = pages * page_size if spec.chunk_tokens(page_size) else config.budget
        keep = select_tokens(scores, budget, page_size=page_size, **config.select_options(),
                             lengths=None if lengths is None else lengths.to(scores.device))
        self._near_ties += near_ties(scores, keep, exact=config.pool_kernel_size() == 1)
        keep = torch.cat([torch.ones(H, fixed, dtype=torch.bool), keep.cpu()], dim=1)
        keys[:] = [k_all[keep[h].to(k_all.device), h] for h in range(H)]
        values[:] = [v_all[keep[h].to(v_all.device), h] for h in range(H)]
        positions[:] = [held[h][keep[h]] for h in range(H)]

    def _greedy(self, last_hidden, tokens: list[int], logprobs: list[float], top5: list[list[int]]) -> int:
        """The greedy token after `last_hidden`, appended with its logprob and the top 5 to the lists."""
        logp = self.model.lm_head(self.model.model.norm(last_hidden))[0].float().log_softmax(-1)
        tok = int(torch.argmax(logp))
        tokens.append(tok)
        logprobs.append(float(logp[tok]))
        top5.append(logp.topk(5).indices.tolist())
        return tok

    def _decode(self, kv, last_hidden, pending: list[int], pos: int, max_tokens: int,
                kept_per_layer: list[list[int]]) -> ReferenceResult:
        """Token by token over the per-head caches `kv` from position `pos`: the `pending` prompt tokens
        (the rest of the prompt after evict_at), then greedy decoding from `last_hidden`."""
        model = self.model.model
        tokens, logprobs, top5 = [], [], []
        while len(tokens) < max_tokens:
            if not pending:
                tok = self._greedy(last_hidden, tokens, logprobs, top5)
                pending = [tok]
                if len(tokens) == max_tokens:
                    break
            tok = pending.pop(0)
            hidden = model.embed_tokens(torch.tensor([tok], device=self.device))
            for layer, (keys, values) in zip(model.layers, kv):
                q, k, v = self._layer_qkv(layer, hidden, torch.tensor([pos], device=self.device))
                for h in range(self.num_kv_heads):
                    keys[h] = torch.cat([keys[h], k[:, h]])
                    values[h] = torch.cat([values[h], v[:, h]])
                hidden = self._finish_layer(layer, hidden, self._attend(q, keys, values, causal_offset=None))
            last_hidden = hidden
            pos += 1
        return ReferenceResult(tokens, logprobs, top5, kept_per_layer)


def near_ties(scores: torch.Tensor, keep: torch.Tensor, exact: bool) -> int:
    """Heads whose last kept score is within DESIGN.md §7.3's tolerance (1e-3 relative) of the best evicted one,
    where rounding may decide: a different float path (vLLM's RoPE and kernels) may keep either. Exact
    ties count only with `exact` (no pooling: distinct tokens with equal scores, e.g. K-norm on a repeated
    token, whose norm RoPE does not change); pooled ties copy one value, which both paths share."""
    count = 0
    for row, kept in zip(scores.double(), keep):
        if kept.all() or not kept.any():
            continue
        last, best = row[kept].min(), row[~kept].max()
        gap = float(last - best)
        if (exact or gap > 0) and gap <= 1e-3 * abs(float(last)) + 1e-30:
            count += 1
    return count
