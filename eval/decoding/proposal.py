"""What passes between the decoder and a proposer: the sampling settings both sides warp with,
the context a proposer drafts after, and the drafted tokens (a chain or a tree) with the
distributions they were drawn from. The proposers themselves are in :mod:`eval.decoding.proposers`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.eval.decoding.verify import top1, warp


@dataclass(frozen=True)
class Sampling:
    """Sampling settings shared by target and draft (``temperature == 0`` is greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        """Temperature 0: every token is the argmax, a point mass that needs no distribution."""
        return self.temperature == 0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.temperature, self.top_k, self.top_p)

    def token(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from raw ``logits (V,)``: the argmax when greedy, else a sample from the
        warped distribution (``sample_with_q`` when a draft needs that distribution too)."""
        if self.greedy:
            return int(top1(logits))
        return self.sample_with_q(logits, generator)[0]

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens ``(n,)`` from raw ``logits (n, V)``, kept on the device (no host transfer):
        the argmax when greedy (``q`` None: point masses), else one draw per row from the warped
        distribution, returned as ``q (n, V)``."""
        if self.greedy:
            return top1(logits), None
        q = self.warp(logits)
        on = q if generator is None or q.device == generator.device else q.to(generator.device)
        return torch.multinomial(on, 1, generator=generator).squeeze(-1).to(q.device), q

    def sample_with_q(self, logits: torch.Tensor,
                      generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
        """A token sampled from the warped distribution of raw ``logits (V,)``, and that
        distribution (a draft's ``q``). Not for greedy decoding: a greedy draft is a point mass,
        which the verifier takes without a one-hot (``Proposal.q`` None), so none is built."""
        if self.greedy:
            raise ValueError("greedy decoding draws no distribution; use Sampling.token")
        q = self.warp(logits)
        # the draw happens on the generator's device (the target's; a draft elsewhere moves q)
        on = q if generator is None or q.device == generator.device else q.to(generator.device)
        return int(torch.multinomial(on, 1, generator=generator)), q


@dataclass
class DecodeContext:
    """What a proposer may look at: the committed sequence and the sampling settings."""

    tokens: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    generator: torch.Generator | None = None
    budget: int | None = None  # the most drafts a proposal can still have committed (None: any)


@dataclass
class Proposal:
    """Drafted tokens as a tree (a chain is the tree with ``parents = [-1, 0, 1, ...]``).

    Attributes:
        tokens: ``(N,)`` long, target ids, topologically ordered.
        parents: ``(N,)`` long, parent node index or ``-1`` for children of the pending token.
        q: ``(N, V)`` the distribution each node was drawn from, or ``None`` when every node is a
            deterministic choice (point mass on its token).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None

    @staticmethod
    def chain(tokens: Sequence[int], q: torch.Tensor | None = None) -> Proposal:
        n = len(tokens)
        return Proposal(torch.tensor(list(tokens), dtype=torch.long),
                        torch.arange(-1, n - 1, dtype=torch.long), q)

    @staticmethod
    def empty() -> Proposal:
        return Proposal.chain([])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        n = len(self)
        return bool(torch.equal(self.parents, torch.arange(-1, n - 1, dtype=torch.long)))

    def depth(self) -> torch.Tensor:
        """``(N,)`` depth of each node (1 for children of the pending token)."""
        d = torch.zeros(len(self), dtype=torch.long)
        for j, par in enumerate(self.parents.tolist()):
            d[j] = 1 if par < 0 else d[par] + 1
        return d
