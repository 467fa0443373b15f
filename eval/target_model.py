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
from transformers import DynamicCache, PreTrainedModel

from data.target import FORCE_GQA_ENV, native_gqa  # noqa: F401 (FORCE_GQA_ENV: tests)


@dataclass
class TargetOutput:
    """What one target forward returns, for the ``T`` tokens it was fed (batch dim removed).

    Attributes:
        logits: ``(T, V)`` next-token logits at each fed position.
        hidden: ``(T, H)`` final-norm hidden states (the LM head's input).
        layers: ``(L, T, H)`` hidden states of the requested layer ids (``hidden_states[i]``,
            0 = embeddings), or ``None`` when none were requested.
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    layers: torch.Tensor | None = None

    def select(self, rows: torch.Tensor | Sequence[int]) -> TargetOutput:
        """The same output restricted to ``rows`` (positions)."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.logits.device)
        layers = None if self.layers is None else self.layers[:, idx]
        return TargetOutput(self.logits[idx], self.hidden[idx], layers)


class Target:
    """A HF causal LM with a :class:`~transformers.DynamicCache`, batch size one.

    Args:
        model: an eval-mode causal LM (e.g. ``LlamaForCausalLM``) exposing ``model.model`` (the
            decoder stack returning ``last_hidden_state``) and ``model.lm_head``.
        layer_ids: extra hidden-state layer ids to return (``hidden_states[i]``), e.g. for heads
            that fuse several target layers.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int] = ()) -> None:
        n_layers = model.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i <= n_layers]
        if bad:
            raise ValueError(f"layer_ids {bad} out of range: valid ids are 0..{n_layers} "
                             "(0 = embeddings, i = output of decoder layer i)")
        self.model = model
        self.layer_ids = list(layer_ids)
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.forwards = 0
        self._cache_kw = cache_kwarg(model.model)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def seq_len(self) -> int:
        """Number of tokens currently in the cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def reset(self) -> None:
        """Drop the cache (start of a new request)."""
        self.cache = DynamicCache(config=self.model.config)
        self.forwards = 0

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> TargetOutput:
        if self.cache is None:
            self.reset()
        ids = ids.to(self.device).long().view(1, -1)  # (1, T)
        want_layers = bool(self.layer_ids)
        with native_gqa(self.device.type == "cpu" and ids.shape[1] > 1):
            out = self.model.model(input_ids=ids, **{self._cache_kw: self.cache}, use_cache=True,
                                   position_ids=position_ids, attention_mask=attention_mask,
                                   output_hidden_states=want_layers)
        hidden = out.last_hidden_state  # (1, T, H), final-norm output
        logits = self.model.lm_head(hidden)  # (1, T, V)
        layers = None
        if want_layers:
            layers = torch.stack([out.hidden_states[i][0] for i in self.layer_ids])  # (L, T, H)
        self.forwards += 1
        return TargetOutput(logits[0].float(), hidden[0], layers)

    def prefill(self, prompt_ids: torch.Tensor) -> TargetOutput:
        """Reset the cache and feed the prompt.

        Args:
            prompt_ids: ``(T,)`` token ids, ``T >= 1``.

        Returns:
            :class:`TargetOutput` for all prompt positions.
        """
        if prompt_ids.numel() == 0:
            raise ValueError("prompt_ids is empty: the target needs at least one token to "
                             "condition on")
        self.reset()
        return self._forward(prompt_ids)

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
        mask = torch.ones(n, past + n, dtype=torch.bool)
        mask[:, past:] = anc
        depth = anc.sum(-1)  # (N,) depth of each node (1 for children of the root)
        pos = (past + depth - 1).view(1, -1).to(self.device)
        return self._forward(token_ids, position_ids=pos,
                             attention_mask=mask.view(1, 1, n, past + n).to(self.device))

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
        # move the accepted entries right after the prefix, then crop: O(path), not O(context)
        moved = [(d, s) for d, s in enumerate(src, start=n_prefix) if d != s]
        if moved:
            dst_idx = torch.tensor([d for d, _ in moved], device=self.device)
            src_idx = torch.tensor([s for _, s in moved], device=self.device)
            for layer in self.cache.layers:
                for t in (layer.keys, layer.values):  # (B, heads, T, d)
                    t[:, :, dst_idx] = t[:, :, src_idx]
        self.crop(n_prefix + len(src))


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self matrix of a topologically ordered tree.

    Args:
        parents: ``(N,)`` parent indices, ``-1`` for roots, ``parents[j] < j``.

    Returns:
        ``(N, N)`` bool, ``[i, j]`` True when node ``j`` is ``i`` or one of its ancestors.
    """
    n = int(parents.shape[0])
    anc = torch.eye(n, dtype=torch.bool)
    for j, par in enumerate(parents.tolist()):
        if par >= j:
            raise ValueError("tree nodes must be topologically ordered (parents[j] < j)")
        if par >= 0:
            anc[j] |= anc[par]
    return anc


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward keyword for the KV cache: ``cache`` in newer transformers, else
    ``past_key_values`` (avoids the deprecation path where both exist)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
