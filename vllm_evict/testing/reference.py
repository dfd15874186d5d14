"""Independent reference for engine exactness tests: a plain torch decoder loop over an HF Llama/Qwen2
checkpoint that evicts with the engine-free policy code and decodes over kept tokens only.

No vLLM code is involved: attention is explicit softmax over per-head key lists, RoPE comes from the
HF model, positions stay the original ones (kept keys are not re-rotated; new tokens continue at n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_evict.policies import EvictionConfig, score_tokens, select_tokens


@dataclass
class ReferenceResult:
    token_ids: list[int]
    logprobs: list[float]          # log-softmax of the chosen token at each step
    top5: list[list[int]]          # the 5 most likely tokens at each step
    kept_per_layer: list[list[int]]  # kept tokens per KV head, per layer


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

    def _attend(self, q, keys, values, causal_offset: int | None):
        """q [T, Hq, D]; keys/values per KV head: lists of [L_h, D]. With causal_offset, query t sees
        the first causal_offset + t + 1 keys of every head (prefill); else all keys (decode)."""
        g = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        for h in range(self.num_kv_heads):
            qh = q[:, h * g: (h + 1) * g]                          # [T, g, D]
            logits = torch.einsum("tgd,ld->tgl", qh, keys[h]) * self.scale
            if causal_offset is not None:
                T, L = q.shape[0], keys[h].shape[0]
                mask = torch.arange(L, device=q.device)[None, :] > (causal_offset + torch.arange(T, device=q.device))[:, None]
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
        model = self.model.model
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
                                      **config.score_options())
                keep = select_tokens(scores, config.budget, page_size=page_size, **config.select_options())
            keys = [k[:, h] if keep is None else k[keep[h], h] for h in range(self.num_kv_heads)]
            values = [v[:, h] if keep is None else v[keep[h], h] for h in range(self.num_kv_heads)]
            kv.append((keys, values))
            kept_per_layer.append([kh.shape[0] for kh in keys])
        return self._decode(kv, last_hidden, list(prompt_ids[E:]), E, max_tokens, kept_per_layer)

    @torch.no_grad()
    def generate_chunked(self, prompt_ids: list[int], max_tokens: int, config: EvictionConfig, chunk: int,
                         page_size: int = 16) -> ReferenceResult:
        """Greedy tokens under block-wise eviction during prefill (SPEC §4.3): the prompt is prefilled in
        chunks of `chunk` tokens; each chunk attends to the tokens its layer holds plus itself (causally),
        and after it every head holding more than P pages (P from the whole prompt) is cut back to its
        P*page_size best tokens by `config`'s scores recomputed on what it holds now."""
        model = self.model.model
        n = len(prompt_ids)
        pages = config.num_pages(n, page_size)
        limit = None if pages is None else pages * page_size
        empty = torch.empty(0, self.head_dim, device=self.device)
        kv = [([empty] * self.num_kv_heads, [empty] * self.num_kv_heads) for _ in model.layers]
        for start in range(0, n, chunk):
            ids = prompt_ids[start: start + chunk]
            hidden = model.embed_tokens(torch.tensor(ids, device=self.device))
            positions = torch.arange(start, start + len(ids), device=self.device)
            for layer, (keys, values) in zip(model.layers, kv):
                q, k, v = self._layer_qkv(layer, hidden, positions)
                held = keys[0].shape[0]
                keys[:] = [torch.cat([keys[h], k[:, h]]) for h in range(self.num_kv_heads)]
                values[:] = [torch.cat([values[h], v[:, h]]) for h in range(self.num_kv_heads)]
                hidden = self._finish_layer(layer, hidden, self._attend(q, keys, values, causal_offset=held))
                if limit is not None and held + len(ids) > limit:
                    k_held, v_held = torch.stack(keys, dim=1), torch.stack(values, dim=1)  # [held, H, D]
                    w = config.window_size()
                    scores = score_tokens(config.policy, q[max(len(ids) - w, 0):] if w else q[:0], k_held, v_held,
                                          scale=self.scale, **config.score_options())
                    keep = select_tokens(scores, limit, page_size=page_size, **config.select_options())
                    keys[:] = [k_held[keep[h], h] for h in range(self.num_kv_heads)]
                    values[:] = [v_held[keep[h], h] for h in range(self.num_kv_heads)]
            last_hidden = hidden[-1:]
        kept_per_layer = [[kh.shape[0] for kh in keys] for keys, _ in kv]
        return self._decode(kv, last_hidden, [], n, max_tokens, kept_per_layer)

    def _decode(self, kv, last_hidden, pending: list[int], pos: int, max_tokens: int,
                kept_per_layer: list[list[int]]) -> ReferenceResult:
        """Token by token over the per-head caches `kv` from position `pos`: the `pending` prompt tokens
        (the rest of the prompt after evict_at), then greedy decoding from `last_hidden`."""
        model = self.model.model
        tokens, logprobs, top5 = [], [], []
        while len(tokens) < max_tokens:
            if not pending:
                logits = self.model.lm_head(model.norm(last_hidden))[0].float()
                logp = logits.log_softmax(-1)
                tok = int(torch.argmax(logits))
                tokens.append(tok)
                logprobs.append(float(logp[tok]))
                top5.append(logp.topk(5).indices.tolist())
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
