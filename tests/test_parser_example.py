"""The dependency-parser example of the README's inference-core section (issue 20.8), run as
the README runs it (``tests/test_readme.py`` execs every python block): EXAMPLE is the exact
text of the block."""

from __future__ import annotations

import time

import pytest
import torch

EXAMPLE = """\
import torch
from torch import nn
from structattn import (DependencyCRF, NonProjectiveDependencyCRF, is_projective,
                        projectivize, structured_nll)

torch.manual_seed(0)
V, N = 30, 9                                    # vocabulary (0 = ROOT), ROOT + up to 8 words

class Biaffine(nn.Module):                      # arc scores from any encoder: [B, N] -> [B, N, N]
    def __init__(self, dim):
        super().__init__()
        self.embed, self.distance = nn.Embedding(V, dim), nn.Embedding(2 * N, 1)
        self.head, self.dep = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, words):
        x, pos = self.embed(words), torch.arange(words.shape[1])
        bias = self.distance(pos[:, None] - pos + N).squeeze(-1)   # by signed distance h - m
        return self.head(x) @ self.dep(x).transpose(1, 2) + bias   # [b, h, m]: head h -> word m

# a toy treebank: the trees of a random "teacher" parser that prefers short arcs, ROOT at 0,
# one child of ROOT (as in UD); heads [B, N] with -1 at ROOT and padding
words = torch.randint(1, V, (400, N))
words[:, 0] = 0
lengths = torch.randint(4, N + 1, (400,))       # positions, ROOT included
with torch.no_grad():
    teacher = Biaffine(4)
    teacher.distance.weight.copy_(-(torch.arange(2 * N) - N).abs()[:, None])
    gold = NonProjectiveDependencyCRF(teacher(words), lengths, multiroot=False).argmax
print(int((~is_projective(gold, lengths)).sum()), "of 400 gold trees are non-projective")
train, dev = slice(0, 320), slice(320, 400)
train_heads = projectivize(gold[train], lengths[train])  # DependencyCRF: projective trees only

parser = Biaffine(8)
optimizer = torch.optim.Adam(parser.parameters(), lr=0.05)
for epoch in range(80):
    tree = DependencyCRF(parser(words[train]), lengths[train], multiroot=False)
    loss = structured_nll(tree, train_heads, reduction="token")  # -log p(gold tree) per word
    optimizer.zero_grad()
    loss.backward()                             # gradient: arc marginals - gold arcs
    optimizer.step()

with torch.no_grad():                           # MAP trees (Eisner) against the original trees
    predicted = DependencyCRF(parser(words[dev]), lengths[dev], multiroot=False).argmax
real = gold[dev] >= 0                           # the words (not ROOT, not padding)
uas = (predicted == gold[dev])[real].float().mean().item()
print(f"train loss {loss.item():.3f} per word, dev UAS {uas:.1%}")
"""


def test_parser_example_trains_a_parser() -> None:
    """The example runs in a few seconds, the loss is finite and the parser learns the
    teacher's trees (dev UAS far above chance)."""
    start = time.perf_counter()
    namespace: dict[str, object] = {}
    exec(compile(EXAMPLE, "README.md[parser example]", "exec"), namespace)
    seconds = time.perf_counter() - start
    loss, uas = namespace["loss"], namespace["uas"]
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss)
    assert isinstance(uas, float) and uas > 0.7, uas  # chance: about 1 / 5
    assert seconds < 60, seconds  # about 3 s on an idle 2-core CPU


def test_the_readme_shows_this_example() -> None:
    """Once pasted into the README, its block stays the text tested here."""
    from test_readme import BLOCKS

    pasted = [block for block in BLOCKS if "class Biaffine" in block]
    if not pasted:
        pytest.skip("the parser example is not in the README yet")
    assert pasted == [EXAMPLE]
