"""Independent reference for engine exactness tests: a plain torch decoder loop over an HF checkpoint
(Llama, Qwen2, and the hybrids Gemma 3 and GPT-OSS) that evicts with the engine-free policy code and
decodes over kept tokens only.

No vLLM code is involved. The HF model computes everything but attention (its norms, RoPE, MLP or MoE,
and linear-attention layers such as Qwen3-Next's Gated DeltaNet, whose state lives in the HF cache);
attention goes through an attention function registered with transformers (`AttentionInterface`) that
keeps its own per-layer, per-KV-head key/value lists with their original positions and computes an
explicit softmax over them: causal by position, limited to the last `sliding_window` positions on a
sliding-window layer, with the layer's attention sinks (GPT-OSS) as one more logit per query head in the
denominator. Only full-attention layers evict (docs/DESIGN.md); positions stay the original ones (kept
keys are not re-rotated; new tokens continue at n).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import copy

import torch
import torch.nn.functional as F

from vllm_evict.policies import EvictionConfig, score_tokens, select_tokens

ATTENTION_NAME = "vllm_evict_reference"
_ACTIVE: list = []  # the callback of the forward in progress (attention receives no other handle)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
               s_aux=None, **kwargs):
    """transformers' attention-function signature: query [1, Hq, T, D], key/value [1, Hkv, L, D] whose last
    T rows are this forward's tokens (the HF cache may prepend its own copy of earlier ones, unused here).
    Returns ([1, T, Hq, D], None) from the active callback."""
    T = query.shape[2]
    out = _ACTIVE[-1](module.layer_idx, query[0].transpose(0, 1), key[0, :, -T:].transpose(0, 1),
                      value[0, :, -T:].transpose(0, 1))
    return out.unsqueeze(0), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


@dataclass
class LayerKV:
    """What one layer holds per KV head: keys and values [L_h, D] and their original positions [L_h]."""

    keys: list
    values: list
    positions: list
    queries: dict = field(default_factory=dict)  # position -> query [Hq, D] of every position processed

    @classmethod
    def empty(cls, num_heads: int, head_dim: int, device, dtype) -> "LayerKV":
        none = torch.empty(0, head_dim, device=device, dtype=dtype)
        return cls([none] * num_heads, [none] * num_heads, [torch.empty(0, dtype=torch.int64)] * num_heads)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        H = len(self.keys)
        self.keys[:] = [torch.cat([self.keys[h], k[:, h]]) for h in range(H)]
        self.values[:] = [torch.cat([self.values[h], v[:, h]]) for h in range(H)]
        self.positions[:] = [torch.cat([self.positions[h], pos.cpu()]) for h in range(H)]

    def counts(self) -> list[int]:
        return [k.shape[0] for k in self.keys]


@dataclass
class PrefillEnd:
    logits: torch.Tensor  # [vocab] of the prefix's last token
    cache: object         # the HF cache after the prefix (the linear-attention layers' state)


@dataclass
class ReferenceResult:
    token_ids: list[int]
    logprobs: list[float]          # log-softmax of the chosen token at each step
    top5: list[list[int]]          # the 5 most likely tokens at each step
    kept_per_layer: list[list[int]]  # kept tokens per KV head, per layer (every token: a layer that never evicts)
    near_ties: int = 0             # replay: kept boundaries within DESIGN.md §7.3's tolerance of the next score
    gaps: list[float] = field(default_factory=list)  # the best logprob less the chosen token's, each step


class ReferenceDecoder:
    def __init__(self, model_dir, dtype=torch.float32, device="cpu"):
        from transformers import AutoModelForCausalLM

        _register_attention()
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                          attn_implementation=ATTENTION_NAME).to(self.device).eval()
        cfg = self.model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attention = [getattr(layer, "self_attn", None) for layer in self.model.model.layers]  # None: linear
        self.num_layers = len(attention)
        self.scale = next(a for a in attention if a is not None).scaling
        # per layer: the last positions a query sees (None: all), its sinks [Hq] (None: none); and which evict
        self.windows = [getattr(a, "sliding_window", None) for a in attention]
        self.sinks = [getattr(a, "sinks", None) for a in attention]
        self.attends = [a is not None for a in attention]  # False: a linear-attention layer
        self.evicts = [a and w is None for a, w in zip(self.attends, self.windows)]
        assert all(a.scaling == self.scale for a in attention if a is not None), "one softmax scale for every layer"
        self.rotation = self._future_rotation()

    def _future_rotation(self) -> torch.Tensor | None:
        """expected_attention.mean_rotation over the FUTURE_POSITIONS offsets, from the HF model's global RoPE
        frequencies (rotate-half pairs), as the engine derives it from vLLM's own cos/sin cache."""
        from vllm_evict.policies.expected_attention import FUTURE_POSITIONS, mean_rotation

        inv_freq = getattr(getattr(self.model.model, "rotary_emb", None), "inv_freq", None)
        if inv_freq is None:
            return None
        offsets = torch.arange(1, FUTURE_POSITIONS + 1, dtype=torch.float32)
        angles = offsets[:, None] * inv_freq.float().cpu()[None, :]
        return mean_rotation(angles.cos(), angles.sin(), self.head_dim, neox=True).to(self.device)

    def _forward(self, ids: list[int], start: int, callback, cache=None) -> tuple[torch.Tensor, object]:
        """The model over tokens `ids` at positions start..; attention by callback(layer, q [T, Hq, D],
        k [T, H, D], v [T, H, D]) -> [T, Hq, D]; `cache`: the HF cache of the tokens before (None: none),
        which holds the linear-attention layers' state. Returns the last token's logits [vocab] (float32)
        and the cache after these tokens."""
        pos = torch.arange(start, start + len(ids), device=self.device)
        _ACTIVE.append(callback)
        try:
            out = self.model(input_ids=torch.tensor([ids], device=self.device), position_ids=pos.unsqueeze(0),
                             past_key_values=cache, use_cache=True, cache_position=pos, logits_to_keep=1)
        finally:
            _ACTIVE.pop()
        return out.logits[0, -1].float(), out.past_key_values

    def _attend(self, layer: int, q: torch.Tensor, held: LayerKV, q_pos: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] at positions q_pos over what each KV head of `layer` holds: keys at positions <= the
        query's (and within its sliding window), the layer's sinks in the denominator."""
        g = self.num_heads // self.num_kv_heads
        window, sinks = self.windows[layer], self.sinks[layer]
        out = torch.empty_like(q)
        qp = q_pos.cpu()[:, None]
        for h in range(self.num_kv_heads):
            qh = q[:, h * g: (h + 1) * g]                          # [T, g, D]
            logits = torch.einsum("tgd,ld->tgl", qh, held.keys[h]) * self.scale
            kp = held.positions[h][None, :]
            hidden = kp > qp
            if window is not None:
                hidden |= kp <= qp - window
            logits = logits.masked_fill(hidden.to(q.device)[:, None, :], float("-inf"))
            if sinks is not None:
                sink = sinks[h * g: (h + 1) * g].to(logits.dtype).view(1, g, 1).expand(logits.shape[0], g, 1)
                probs = torch.cat([logits, sink], dim=-1).float().softmax(-1)[..., :-1].to(logits.dtype)
            else:
                probs = logits.softmax(-1)
            out[:, h * g: (h + 1) * g] = torch.einsum("tgl,ld->tgd", probs, held.values[h])
        return out

    def _layers_from(self, per_layer, keep: list) -> list[LayerKV]:
        """Each layer's store after a prefill whose (q, k, v) are `per_layer`, keeping keep[layer] ([H, E]
        bool; None: every token)."""
        stores = []
        for qkv, kept in zip(per_layer, keep):
            if qkv is None:  # a linear-attention layer: its state is in the HF cache
                stores.append(None)
                continue
            q, k, v = qkv
            E = k.shape[0]
            pos = torch.arange(E)
            rows = [slice(None) if kept is None else kept[h].to(k.device) for h in range(self.num_kv_heads)]
            stores.append(LayerKV([k[r, h] for h, r in enumerate(rows)], [v[r, h] for h, r in enumerate(rows)],
                                  [pos[r.cpu() if kept is not None else r] for r in rows]))
        return stores

    @torch.no_grad()
    def prefill(self, prefix_ids: list[int]):
        """Causal attention over the prefix: per layer (q, k, v) post-RoPE ([T, Hq|H, D]; None for a
        linear-attention layer), and where it ended (PrefillEnd: the last token's logits, the HF cache)."""
        per_layer = [None] * self.num_layers
        pos = torch.arange(len(prefix_ids), device=self.device)

        def attend(layer, q, k, v):
            per_layer[layer] = (q, k, v)
            return self._attend(layer, q, LayerKV([k[:, h] for h in range(self.num_kv_heads)],
                                                  [v[:, h] for h in range(self.num_kv_heads)],
                                                  [pos.cpu()] * self.num_kv_heads), pos)

        return per_layer, PrefillEnd(*self._forward(prefix_ids, 0, attend))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_tokens: int, config: EvictionConfig | None = None,
                 evict_at: int | None = None, page_size: int = 16, prefill=None,
                 keep_override: list[torch.Tensor] | None = None, forced: list[int] | None = None) -> ReferenceResult:
        """Greedy tokens when the KV of prompt_ids[:evict_at] (default: the whole prompt) is evicted with
        `config` at the end of its prefill. `prefill` = self.prefill(prompt_ids[:E]) may be passed to reuse it.
        `keep_override` (per layer [H, E] bool; None for a layer that does not evict) replaces the
        reference's own selection (GPU checks feed the engine's kept sets to isolate compaction + attention
        from bf16 scoring near-ties). `forced`: decode these tokens instead of the greedy ones (teacher
        forcing: `gaps` then says how far each is from the reference's best; a bf16 engine's tokens part from
        an exact decoder's at near-ties)."""
        n = len(prompt_ids)
        E = n if evict_at is None else min(evict_at, n)
        per_layer, end = prefill if prefill is not None else self.prefill(prompt_ids[:E])
        keep = [None] * self.num_layers
        for layer, qkv in enumerate(per_layer):
            if qkv is None:
                continue
            q, k, v = qkv
            if keep_override is not None:
                keep[layer] = None if keep_override[layer] is None else keep_override[layer].to(k.device)
            elif self.evicts[layer] and config is not None and config.num_pages(E, page_size) is not None:
                w = config.window_size()
                scores = score_tokens(config.policy, q[E - w:] if w else q[:0], k, v, scale=self.scale,
                                      context=self._context(layer, torch.arange(E).expand(self.num_kv_heads, E),
                                                            0, config),
                                      future_rotation=self.rotation, **config.score_options())
                keep[layer] = select_tokens(scores, config.budget, page_size=page_size, **config.select_options())
        stores = self._layers_from(per_layer, keep)
        kept_per_layer = [store.counts() if store is not None else [] for store in stores]
        return self._decode(stores, end.logits, copy.deepcopy(end.cache), list(prompt_ids[E:]), E, max_tokens,
                            kept_per_layer, forced)

    @torch.no_grad()
    def replay(self, prompt_ids: list[int], max_tokens: int, spec, page_size: int = 16,
               forced: list[int] | None = None) -> ReferenceResult:
        """Greedy tokens of a request that compacts at DESIGN.md §4.8's points (`spec`: request_config.RequestEviction;
        under Ada-KV each head holds its own number of tokens after a point): its prompt eviction (one-shot at E, or block-wise in chunks of C tokens: each
        chunk attends to what its layer holds plus itself, and every chunk end past P pages compacts), then
        a decode point after the forward that writes each C_d-th generated token's K/V. At a point each head
        of a full-attention layer scores what it holds (under protect_prompt only its generated tokens) with
        the window queries of the last w of them, kept from when they were processed, and keeps its best P
        (P_d) pages, scored by the request's policy (its chunk policy at block-wise cuts before the last, its
        decode policy at decode points). kept_per_layer: what each head holds at the end. `forced`: as in `generate`."""
        config = spec.config
        self._near_ties = 0
        n = len(prompt_ids)
        E = spec.eviction_point(n)
        pages = config.num_pages(E, page_size)
        chunk = spec.chunk_tokens(page_size) if pages else 0
        # the cuts before the last keep their own budget (or nothing: no such cut), scored by the chunk config
        chunk_config = spec.chunk_config() if chunk else None
        chunk_pages = chunk_config.num_pages(E, page_size) if chunk else None
        chunk_pages = None if chunk_pages is None else max(chunk_pages, pages)
        decode_every, decode_config = spec.decode_tokens(page_size), spec.decode_config()
        stores = [LayerKV.empty(self.num_kv_heads, self.head_dim, self.device, self.model.dtype)
                  for _ in range(self.num_layers)]
        points, cache = 0, None

        def forward(ids: list[int], start: int, point: str | None, point_config=config, point_pages=pages):
            """One forward of tokens ids at positions start.. (causal over what each layer holds), then
            the compaction `point` ("prompt" / "decode") of every full-attention layer, scored by
            `point_config` to `point_pages` pages (a prompt point); the last logits."""
            nonlocal points, cache
            pos = torch.arange(start, start + len(ids), device=self.device)

            def attend(layer, q, k, v):
                store = stores[layer]
                for t, p in enumerate(pos.tolist()):
                    store.queries[p] = q[t]
                store.append(k, v, pos)
                out = self._attend(layer, q, store, pos)
                if point is not None and self.evicts[layer]:
                    self._compact(layer, store, spec, point_config, point, points, point_pages, n, page_size)
                return out

            logits, cache = self._forward(ids, start, attend, cache)
            if point is not None:
                points += 1
            return logits

        if pages is None:  # no prompt eviction: prefill, then the decode points
            logits, done = forward(prompt_ids, 0, None), n
        elif chunk:
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                if end == n:  # the last cut: the request's policy and budget
                    logits = forward(prompt_ids[start:end], start, "prompt")
                else:  # every chunk end past P_c pages (DESIGN.md §4.3)
                    over = chunk_pages is not None and end > chunk_pages * page_size
                    logits = forward(prompt_ids[start:end], start, "prompt" if over else None, chunk_config,
                                     chunk_pages)
            done = n
        else:
            logits, done = forward(prompt_ids[:E], 0, "prompt"), E
        result = ReferenceResult([], [], [], [], 0)
        pending = list(prompt_ids[done:])
        while len(result.token_ids) < max_tokens:
            if not pending:
                pending = [self._greedy(logits, result, forced)]
                if len(result.token_ids) == max_tokens:
                    break
            written = done + 1 - n  # generated tokens whose K/V this forward writes
            point = "decode" if decode_every and written > 0 and written % decode_every == 0 else None
            logits = forward([pending.pop(0)], done, point, decode_config)
            done += 1
        result.kept_per_layer = [store.counts() if attends else [] for store, attends in zip(stores, self.attends)]
        result.near_ties = self._near_ties
        return result

    def _context(self, layer: int, positions: torch.Tensor, index: int, config):
        """Where a layer's scored tokens sit (DESIGN.md §4.8 e): original positions [H, n], heads 0..H_kv-1,
        compaction index, the request's seed."""
        from vllm_evict.policies.random import TokenContext

        H = self.num_kv_heads
        return TokenContext(positions=positions, heads=torch.arange(H), layers=torch.full((H,), layer),
                            compaction=index, seed=config.seed or 0)

    def _compact(self, layer: int, store: LayerKV, spec, config, point: str, index: int, pages: int | None, n: int,
                 page_size: int) -> None:
        """Compaction point `index` of one layer (DESIGN.md §4.8 a): each head keeps its best pages of its candidates
        (under Ada-KV the heads may hold different counts: scored padded to the longest, with their lengths),
        scored and selected by `config` (the request's, its chunk config or its decode config)."""
        H = self.num_kv_heads
        keys, values, positions = store.keys, store.values, store.positions
        counts = store.counts()
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
        q_window = torch.stack([store.queries[p] for p in window_positions]) if w else None
        # the first `sink` tokens each head holds (DESIGN.md §4.8 a); among the generated candidates of
        # protect_prompt, those whose position is below it
        sink = int((cand[0, :m] < config.sink_size()).sum()) if fixed else min(config.sink_size(), m)
        context = self._context(layer, cand, index, config)
        scores = score_tokens(config.policy, q_window, k_all[fixed:], v_all[fixed:], scale=self.scale,
                              **{**config.score_options(), "window": w, "sink": sink}, context=context,
                              future_rotation=self.rotation,
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

    def _greedy(self, logits: torch.Tensor, result: ReferenceResult, forced: list[int] | None) -> int:
        """The greedy token of `logits` (or the next forced one), appended to `result` with its logprob,
        the top 5 and its gap to the best."""
        logp = logits.log_softmax(-1)
        best = int(torch.argmax(logp))
        tok = best if forced is None else forced[len(result.token_ids)]
        result.token_ids.append(tok)
        result.logprobs.append(float(logp[tok]))
        result.top5.append(logp.topk(5).indices.tolist())
        result.gaps.append(float(logp[best] - logp[tok]))
        return tok

    def _decode(self, stores: list[LayerKV], logits, cache, pending: list[int], pos: int, max_tokens: int,
                kept_per_layer: list[list[int]], forced: list[int] | None = None) -> ReferenceResult:
        """Token by token over the per-layer stores from position `pos`: the `pending` prompt tokens (the
        rest of the prompt after evict_at), then greedy (or forced) decoding from `logits`."""
        result = ReferenceResult([], [], [], kept_per_layer)
        while len(result.token_ids) < max_tokens:
            if not pending:
                pending = [self._greedy(logits, result, forced)]
                if len(result.token_ids) == max_tokens:
                    break
            at = torch.tensor([pos], device=self.device)

            def attend(layer, q, k, v):
                stores[layer].append(k, v, at)
                return self._attend(layer, q, stores[layer], at)

            logits, cache = self._forward([pending.pop(0)], pos, attend, cache)
            pos += 1
        return result


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
