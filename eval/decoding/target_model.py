"""`Target`: a causal LM plus its KV cache, as the speculative decoder needs it.

The cache always holds exactly the committed tokens that have been fed to the model. Tokens are
fed once: the prompt by :meth:`Target.prefill`, then draft chains by :meth:`Target.extend` or
draft trees by :meth:`Target.forward_tree`; after verification :meth:`Target.crop` (chain) or
:meth:`Target.keep_path` (tree) drop the rejected entries, so neither the prompt nor accepted
tokens are ever recomputed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from draftsmith.data.attention import native_gqa
from draftsmith.eval.decoding.kv_cache import SlabCache
from draftsmith.heads.draft_config import check_attention_layers, text_config


@dataclass
class TargetOutput:
    """What one target forward returns, for the ``T`` tokens it was fed (batch dim removed).

    Attributes:
        logits: ``(R, V)`` next-token logits at the last ``R`` fed positions, in the model's
            dtype (``R = T``, except after :meth:`Target.prefill`: ``R = 1``, the last prompt
            position, the only one read). Sampling warps them in float32; an argmax needs no copy.
        hidden: ``(T, H)`` final-norm hidden states (the LM head's input).
        layers: ``(L, T, H)`` hidden states of the requested layer ids (``hidden_states[i]``,
            0 = embeddings), or ``None`` when none were requested.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    layers: torch.Tensor | None = None

    def select(self, rows: torch.Tensor | Sequence[int]) -> TargetOutput:
        """The same output restricted to ``rows`` (positions; logits of rows that have them)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.hidden.device)
        skip = self.hidden.shape[0] - self.logits.shape[0]  # rows without logits (a prefill)
        layers = None if self.layers is None else self.layers[:, idx]
        logit_idx = idx[idx >= skip] - skip if skip else idx
        return TargetOutput(self.logits[logit_idx], self.hidden[idx], layers)


class Target:
    """A HF causal LM with a preallocated KV cache (:func:`new_cache`), batch size one.

    Any standard transformers causal LM works through its own attention and cache classes:
    Llama, Qwen 2/3, Mistral, Phi-3, Gemma 2/3 (sliding-window and full-attention layers, scaled
    embeddings, final logit soft-capping), tied or untied LM heads. Every cache layer keeps all
    positions (:func:`new_cache`), so a crop or a path keep is a plain index operation;
    sliding-window layers get their window from the attention mask (:func:`layer_masks`).

    Args:
        model: an eval-mode causal LM exposing ``model.model`` (the decoder stack returning
            ``last_hidden_state``) and its output embeddings (the LM head).
        layer_ids: extra hidden-state layer ids to return (``hidden_states[i]``), e.g. for heads
            that fuse several target layers.

    Raises:
        UnsupportedTargetError: the model has layers whose state cannot be rolled back
            (recurrent, chunked attention) or no decoder stack / LM head.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int] = ()) -> None:
        check_target_structure(model)
        n_layers = model.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i <= n_layers]
        if bad:
            raise ValueError(f"layer_ids {bad} out of range: valid ids are 0..{n_layers} "
                             "(0 = embeddings, i = output of decoder layer i)")
        self.model = model
        self.layer_ids = list(layer_ids)
        self.device = next(model.parameters()).device
        self.cache: SlabCache | None = None
        self.forwards = 0
        self._cache_kw = cache_kwarg(model.model)
        self._softcap = getattr(text_config(model.config), "final_logit_softcapping", None)
        self._ones_block = torch.ones(0, 0, dtype=torch.bool)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def seq_len(self) -> int:
        """Number of tokens currently in the cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reset(self) -> None:
        """Empty the cache (start of a new request; its buffers are kept)."""
        if self.cache is None:
            self.cache = new_cache()
        else:
            self.cache.crop(-self.seq_len)
        self.forwards = 0

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 last_only: bool = False) -> TargetOutput:
        if self.cache is None:
            self.reset()
        ids = ids.to(self.device).long().view(1, -1)  # (1, T)
        want_layers = bool(self.layer_ids)
        if attention_mask is not None:
            attention_mask = layer_masks(self.model.config, attention_mask, position_ids,
                                         self.seq_len, self.model.dtype)
        with native_gqa(self.device.type == "cpu" and ids.shape[1] > 1):
            out = self.model.model(input_ids=ids, **{self._cache_kw: self.cache}, use_cache=True,
                                   position_ids=position_ids, attention_mask=attention_mask,
                                   output_hidden_states=want_layers)
        hidden = out.last_hidden_state[0]  # (T, H), final-norm output
        # a fresh (1, H) row for a prefill's last position: a strided view takes torch's slow
        # CPU bf16 path for the LM head
        rows = hidden[-1:].contiguous() if last_only else hidden
        logits = target_logits(self.model, rows, self._softcap)  # (R, V), the model's dtype
        layers = None
        if want_layers:
            layers = torch.stack([out.hidden_states[i][0] for i in self.layer_ids])  # (L, T, H)
        self.forwards += 1
        return TargetOutput(logits, hidden, layers)

    def prefill(self, prompt_ids: torch.Tensor) -> TargetOutput:
        """Reset the cache and feed the prompt.

        Args:
            prompt_ids: ``(T,)`` token ids, ``T >= 1``.

        Returns:
            :class:`TargetOutput` for all prompt positions (logits of the last one only).
        """
        if prompt_ids.numel() == 0:
            raise ValueError("prompt_ids is empty: the target needs at least one token to "
                             "condition on")
        self.reset()
        self.cache.reserve(prompt_ids.numel() + RESERVE)
        return self._forward(prompt_ids, last_only=True)

    def extend(self, token_ids: torch.Tensor) -> TargetOutput:
        """Feed ``K`` tokens after the cached ones (a chain; positions continue the sequence).

        Args:
            token_ids: ``(K,)`` token ids.
        """
        return self._forward(token_ids)

    def forward_tree(self, token_ids: torch.Tensor, parents: torch.Tensor) -> TargetOutput:
        """Feed a token tree after the cached tokens with a tree attention mask.

        Node ``j`` attends to every cached token, to its ancestors and to itself; its position id is
        ``seq_len + depth(j) - 1`` (children of the root have depth 1).

        Args:
            token_ids: ``(N,)`` node token ids, topologically ordered.
            parents: ``(N,)`` parent node indices, ``-1`` for nodes hanging off the cached sequence.

        Returns:
            :class:`TargetOutput` for the ``N`` nodes (row ``j`` = after node ``j``).
        """
        n = int(token_ids.shape[0])
        anc = tree_ancestor_mask(parents)  # (N, N) True where column is ancestor-or-self of row
        past = self.seq_len
        mask = torch.cat([self._ones(n, past), anc], dim=1)  # (N, past + N)
        depth = anc.sum(-1)  # (N,) depth of each node (1 for children of the root)
        pos = (past + depth - 1).view(1, -1).to(self.device)
        return self._forward(token_ids, position_ids=pos,
                             attention_mask=mask.view(1, 1, n, past + n).to(self.device))

    def _ones(self, rows: int, cols: int) -> torch.Tensor:
        """An all-True ``(rows, cols)`` view of a block kept between calls (a tree mask's
        cached part: only the block's own columns change)."""
        have = self._ones_block
        if have.shape[0] < rows or have.shape[1] < cols:
            have = torch.ones(max(rows, 2 * have.shape[0]), max(cols, 2 * have.shape[1]),
                              dtype=torch.bool)
            self._ones_block = have
        return have[:rows, :cols]

    def crop(self, n_keep: int) -> None:
        """Keep only the first ``n_keep`` cached tokens."""
        cur = self.seq_len
        if not 0 <= n_keep <= cur:
            raise ValueError(f"crop(n_keep={n_keep}) needs 0 <= n_keep <= cached length {cur}")
        if n_keep < cur:
            self.cache.crop(n_keep - cur)

    @torch.inference_mode()  # the cache tensors were made under inference mode
    def keep_path(self, n_prefix: int, indices: Sequence[int]) -> None:
        """After :meth:`forward_tree`, keep the prefix and the accepted tree nodes only.

        Args:
            n_prefix: number of cached tokens before the tree block (``seq_len`` before the tree).
            indices: accepted node indices (relative to the tree block), root-to-leaf order.
        """
        src = [n_prefix + int(i) for i in indices]
        if any(k >= self.seq_len for k in src):
            raise ValueError(f"keep_path indices {list(indices)} exceed the cached tree block "
                             f"(cache has {self.seq_len} tokens, prefix {n_prefix})")
        # move the accepted entries right after the prefix (one gather per layer), then crop
        self.cache.keep(n_prefix, src)


RESERVE = 1024  # cache positions reserved after a prompt (more grow the buffers)


def new_cache() -> SlabCache:
    """A preallocated cache (:class:`~eval.decoding.kv_cache.SlabCache`) whose every layer keeps
    all positions, sliding-window layers included, so that index ``i`` of every layer holds
    position ``i`` of the committed sequence and crops and path keeps are index operations;
    windows are applied by the attention masks instead (a sliding-window layer of transformers'
    own cache drops old entries and cannot be cropped)."""
    return SlabCache()


def check_target_structure(model: torch.nn.Module) -> None:
    """Refuse, when the target loads, a structure the decoder cannot drive (with the reason)."""
    from draftsmith.heads.draft_config import UnsupportedTargetError

    check_attention_layers(model.config)
    if getattr(model, "model", None) is None or model.get_output_embeddings() is None:
        raise UnsupportedTargetError(
            f"the target {type(model).__name__} exposes no decoder stack (.model) or LM head "
            "(get_output_embeddings()); draftsmith needs a transformers *ForCausalLM model")


def target_logits(model: torch.nn.Module, hidden: torch.Tensor,
                  softcap: float | None = None) -> torch.Tensor:
    """The target's next-token logits from its final-norm hidden states ``(..., H)``: its LM
    head, then the final soft-capping ``cap * tanh(logits / cap)`` where the model has one
    (Gemma 2), exactly as its own ``forward`` computes them."""
    logits = model.get_output_embeddings()(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, or None when it has none."""
    tc = text_config(config)
    window = getattr(tc, "sliding_window", None)
    types = getattr(tc, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if types is None and getattr(tc, "use_sliding_window", True) is False:
        return None
    return int(window) if window else None


def layer_masks(config, allowed: torch.Tensor, position_ids: torch.Tensor | None,
                past: int, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask(s) to pass a model for a custom (tree) mask over a :func:`new_cache`.

    ``allowed`` is what full-attention layers see; sliding-window layers also drop cached keys
    at least ``window`` positions behind the query (what transformers' own masks do: key ``i``
    is seen from position ``p`` iff ``i > p - window``). Cached key ``i`` holds position ``i``;
    the block's own keys are the query's ancestors, a few positions back, inside any window.

    Args:
        config: the model's config.
        allowed: ``(B, 1, q, past + q)`` bool, True = attend.
        position_ids: ``(B, q)`` positions of the queries (None: ``past + arange(q)``).
        past: cached tokens before the block.
        dtype: the model's dtype (eager attention adds the mask to its scores: it gets an
            additive mask of this dtype; SDPA takes the boolean one).

    Returns:
        ``allowed`` itself for models without sliding-window layers; for models whose layers
        are all windowed (Mistral, Phi-3 with ``sliding_window``) the windowed mask; for models
        with ``layer_types`` a dict ``{layer type: mask}`` (their forward's mask mapping).
    """
    if allowed.dtype != torch.bool:
        return allowed
    if getattr(config, "_attn_implementation", None) == "eager":
        from draftsmith.heads.blocks import additive_mask

        def cast(m: torch.Tensor) -> torch.Tensor:
            return additive_mask(m, dtype)
    else:
        def cast(m: torch.Tensor) -> torch.Tensor:
            return m
    window = sliding_window(config)
    if window is None:
        return cast(allowed)
    q = allowed.shape[-2]
    if position_ids is None:
        position_ids = (torch.arange(q, device=allowed.device) + past).view(1, -1)
    key = torch.arange(allowed.shape[-1], device=allowed.device)  # (kv,)
    inside = (key[None, None, :] > position_ids[:, :, None].to(allowed.device) - window) \
        | (key >= past)[None, None, :]  # (B, q, kv)
    windowed = allowed & inside[:, None]
    types = getattr(text_config(config), "layer_types", None)
    if not types:
        return cast(windowed)
    return {t: cast(windowed if t == "sliding_attention" else allowed) for t in set(types)}


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self matrix of a topologically ordered tree, by tensor ops: one step per
    level (each step ORs in the rows of the parents' parents' ...).

    Args:
        parents: ``(N,)`` parent indices, ``-1`` for roots, ``parents[j] < j``.

    Returns:
        ``(N, N)`` bool, ``[i, j]`` True when node ``j`` is ``i`` or one of its ancestors.
    """
    parents = parents.long().cpu()
    n = int(parents.shape[0])
    idx = torch.arange(n)
    if n and bool((parents >= idx).any()):
        raise ValueError("tree nodes must be topologically ordered (parents[j] < j)")
    anc = torch.eye(n, dtype=torch.bool)
    up = parents  # each node's ancestor `step` levels up (-1: none)
    while n and bool((up >= 0).any()):
        has = up >= 0
        anc[idx[has], up[has]] = True
        up = torch.where(has, parents[up.clamp(min=0)], up)
    return anc


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward keyword for the KV cache: ``cache`` in newer transformers, else
    ``past_key_values`` (avoids the deprecation path where both exist)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
