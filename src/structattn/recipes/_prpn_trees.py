"""PRPN's trees (recipe ``prpn``, #40): distances of gold sentences, greedy SPLIT, and the
split-tree distribution of the notes' eq. 8 (pivot probability d_i / sum_j d_j): its most
likely tree, samples, bracket marginals and the exact expected UF1; the UF1s of
:func:`~structattn.metrics.bracket_f1` as the recipe reports them."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ..data.treebank import TreebankSentence, binarised_spans, branching_spans, random_spans
from ..distributions import SplitTreeDistribution
from ..metrics import bracket_f1
from ..models.prpn_lm import PRPNLanguageModel
from ..trees import split_tree, tree_spans

__all__ = [
    "DECODES",
    "UF1",
    "Decode",
    "decode_scores",
    "decode_trees",
    "expected_scores",
    "parse_baselines",
    "parse_sentences",
    "sampled_scores",
    "uf1_scores",
    "sentence_distances",
    "split_bracket_marginals",
    "split_distribution",
    "tree_from_nodes",
]

Decode = Literal["greedy", "map", "sample"]
#: How a tree is read off the distances d_1..d_n: greedy SPLIT (PRPN), the most likely tree of
#: the split-tree distribution with pivot probabilities d_i / sum_j d_j (notes, eq. 8), or a
#: sample from it
DECODES: tuple[Decode, ...] = ("greedy", "map", "sample")


def split_distribution(distances: Sequence[Sequence[float]]) -> SplitTreeDistribution:
    """The split-tree distribution of eq. 8 for sentences' distances (lists of d_i > 0):
    pivot scores log d_i, so a span picks its pivot with probability d_i / sum_j d_j."""
    size = max(len(d) for d in distances)
    scores = torch.zeros(len(distances), size, dtype=torch.float64)
    for i, d in enumerate(distances):
        scores[i, : len(d)] = torch.tensor(d, dtype=torch.float64).log()
    lengths = torch.tensor([len(d) for d in distances])
    return SplitTreeDistribution(scores, lengths)


def tree_from_nodes(nodes: torch.Tensor, n: int) -> Any:
    """The binary tree (nested pairs over positions, as :func:`~structattn.trees.split_tree`)
    of a split tree given by its nodes, a 0/1 chart [N, N] (node [a, b] inclusive; n words).

    Word i is the pivot of the deepest node covering it, so its depth is the number of nodes
    covering it, and SPLIT on minus that depth splits every node at its pivot."""
    chart = nodes[:n, :n].to(torch.float64)
    covering = chart.flip(1).cumsum(1).flip(1).cumsum(0).diagonal()  # [n], nodes over word i
    return split_tree((-covering).tolist())


def decode_trees(
    distances: Sequence[Sequence[float]], decode: Decode = "greedy", batch_size: int = 32
) -> list[Any]:
    """One tree per sentence from its distances (``decode`` as :data:`DECODES`; ``sample``
    draws from the global torch RNG)."""
    if decode not in DECODES:
        raise ValueError(f"`decode` must be one of {DECODES}, got {decode!r}")
    if decode == "greedy":
        return [split_tree(list(d)) for d in distances]
    trees: list[Any] = [None] * len(distances)
    for chunk in _length_batches(distances, batch_size):
        dist = split_distribution([distances[i] for i in chunk])
        nodes = dist.argmax if decode == "map" else dist.sample(1)[0]
        for row, i in enumerate(chunk):
            trees[i] = tree_from_nodes(nodes[row], len(distances[i]))
    return trees


def _length_batches(distances: Sequence[Sequence[float]], size: int) -> list[list[int]]:
    """Indices of the sentences in batches of similar lengths (longest first), at most
    ``size`` sentences and about 2^22 entries of [B, N, N, N] per batch (long sentences)."""
    order = sorted(range(len(distances)), key=lambda i: -len(distances[i]))
    batches: list[list[int]] = []
    for i in order:
        longest = len(distances[batches[-1][0]]) if batches else 0
        if batches and len(batches[-1]) < min(size, max(1, (1 << 22) // longest**3)):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def split_bracket_marginals(dist: SplitTreeDistribution) -> torch.Tensor:
    """p(span [i, j] (inclusive) is a bracket of the tree) [B, N, N] under ``dist``.

    With PRPN's trees (SPLIT(x_<i), (x_i, SPLIT(x_>i))) the brackets of >= 2 words are the
    nodes [a, b], b > a, and the spans [i, b] of the nodes [a, b] split at a < i < b. The two
    events are disjoint and the pivot of a node is drawn independently of the rest, so
    p(bracket [i, b]) = p(node [i, b]) + sum_{a < i} p(node [a, b]) softmax(s[a..b])_i.
    Cost O(B N^3)."""
    nodes = dist.marginals.detach()  # [B, N (a), N (b)]
    scores = dist.scores.detach()
    size = scores.shape[-1]
    idx = torch.arange(size, device=scores.device)
    a, b, i = idx.view(-1, 1, 1), idx.view(1, -1, 1), idx.view(1, 1, -1)
    inside = (a <= i) & (i <= b)  # [N (a), N (b), N (i)]
    logits = scores.view(-1, 1, 1, size).masked_fill(~inside, float("-inf"))  # [B, a, b, i]
    pivot = torch.softmax(logits.masked_fill(~inside.any(-1, keepdim=True), 0.0), dim=-1)
    split_inside = ((a < i) & (i < b)).to(nodes.dtype)  # pivots strictly inside the node
    via = (nodes.unsqueeze(-1) * pivot * split_inside).sum(1)  # [B, N (b), N (i)]
    own = nodes * (idx.view(-1, 1) < idx.view(1, -1)).to(nodes.dtype)  # nodes of >= 2 words
    return own + via.transpose(1, 2)  # [B, N (i), N (b)]


@torch.no_grad()
def sentence_distances(
    model: PRPNLanguageModel,
    sentences: Sequence[Sequence[str]],
    encode: Any,
    batch_size: int = 64,
) -> list[list[float]]:
    """Distances d_1..d_n of each sentence (list of words), read after ``<eos>`` (id 0, the
    sentence boundary of the LM's stream) from an empty state, in padded batches;
    ``encode(words) -> ids`` maps words to the LM's vocabulary (unknown words -> ``<unk>``)."""
    model.eval()
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for start in range(0, len(sentences), batch_size):
        chunk = sentences[start : start + batch_size]
        width = 1 + max(len(s) for s in chunk)
        inputs = torch.zeros(len(chunk), width, dtype=torch.long, device=device)  # [B, 1 + n]
        mask = torch.zeros(len(chunk), width, dtype=torch.bool, device=device)
        for i, words in enumerate(chunk):
            inputs[i, 1 : 1 + len(words)] = torch.tensor(encode(words), device=device)
            mask[i, : 1 + len(words)] = True
        d = model.distances(inputs, mask)[:, 1:].tolist()  # [B, n], drop the <eos>
        out.extend(row[: len(words)] for words, row in zip(chunk, d, strict=True))
    return out


def parse_sentences(
    model: PRPNLanguageModel,
    sentences: Sequence[Sequence[str]],
    encode: Any,
    batch_size: int = 64,
    decode: Decode = "greedy",
) -> list[tuple[list[float], Any]]:
    """(distances d_1..d_n, tree over positions) of each sentence (list of words): the
    distances of :func:`sentence_distances`, the tree by ``decode`` (:func:`decode_trees`)."""
    distances = sentence_distances(model, sentences, encode, batch_size)
    return list(zip(distances, decode_trees(distances, decode), strict=True))


def uf1_scores(predicted: Sequence[Any], sentences: Sequence[TreebankSentence]) -> dict[str, float]:
    gold = [s.spans for s in sentences]
    lengths = [len(s.words) for s in sentences]
    without = bracket_f1(predicted, gold, lengths).as_dict()
    rooted = bracket_f1(predicted, gold, lengths, include_root=True).as_dict()
    return {
        "uf1_sentence": without["sentence_f1"],
        "uf1_corpus": without["corpus_f1"],
        "uf1_sentence_root": rooted["sentence_f1"],
        "uf1_corpus_root": rooted["corpus_f1"],
        "sentences": without["sentences"],
    }


UF1 = ("uf1_sentence", "uf1_corpus", "uf1_sentence_root", "uf1_corpus_root")


def expected_scores(
    distances: Sequence[Sequence[float]], sentences: Sequence[TreebankSentence]
) -> dict[str, float]:
    """The expected UF1s (as :func:`_scores`, in %) of trees drawn from the split-tree
    distribution of the distances, exactly: a binary tree over n words has n - 1 brackets
    (n - 2 without the root), so a sentence's F1 = 2 matches / (predicted + gold) is linear in
    the matches, whose expectation is a sum of :func:`split_bracket_marginals`; the corpus F1
    is linear in the summed matches the same way."""
    sums = {root: [0.0, 0.0, 0.0, 0.0] for root in (False, True)}  # F1s, matches, pred, gold
    for chunk in _length_batches(distances, 32):
        brackets = split_bracket_marginals(split_distribution([distances[i] for i in chunk]))
        for row, i in enumerate(chunk):
            n = len(distances[i])
            for root, acc in sums.items():
                gold = [(a, b) for a, b in sentences[i].spans if b - a >= 2 and (root or b - a < n)]
                pred = max(n - 1, 0) if root else max(n - 2, 0)
                matches = float(sum(brackets[row, a, b - 1] for a, b in gold))
                acc[0] += 1.0 if pred + len(gold) == 0 else 2 * matches / (pred + len(gold))
                acc[1] += matches
                acc[2] += pred
                acc[3] += len(gold)
    out = {}
    for root, (f1s, total, predicted, golds) in sums.items():
        suffix = "_root" if root else ""
        out[f"uf1_sentence{suffix}"] = 100 * f1s / len(distances)
        out[f"uf1_corpus{suffix}"] = (
            100 * 2 * total / (predicted + golds) if predicted + golds else 0.0
        )
    return out


def sampled_scores(
    distances: Sequence[Sequence[float]],
    sentences: Sequence[TreebankSentence],
    samples: int = 20,
    seed: int = 0,
) -> dict[str, float]:
    """Mean, standard deviation, min and max over ``samples`` draws (each draw: one sampled
    tree per sentence) of the UF1s, under a fixed seed."""
    draws: list[list[Any]] = [[None] * len(distances) for _ in range(samples)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for chunk in _length_batches(distances, 32):
            nodes = split_distribution([distances[i] for i in chunk]).sample(samples)
            for k in range(samples):
                for row, i in enumerate(chunk):
                    draws[k][i] = tree_spans(
                        tree_from_nodes(nodes[k, row], len(distances[i])), include_root=True
                    )
    scores = [uf1_scores(trees, sentences) for trees in draws]
    out = {}
    for key in UF1:
        values = [r[key] for r in scores]
        out[f"{key}_mean"] = statistics.mean(values)
        out[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        out[f"{key}_min"], out[f"{key}_max"] = min(values), max(values)
    return out


def decode_scores(
    distances: Sequence[Sequence[float]],
    sentences: Sequence[TreebankSentence],
    samples: int = 20,
) -> dict[str, Any]:
    """UF1s (:data:`UF1`) of greedy SPLIT (``greedy_*``), of the most likely tree (``map_*``),
    their expectation under the split-tree distribution (``expected_*``) and their spread
    over ``samples`` sampled draws (``sample_*_{mean,std,min,max}``)."""
    out: dict[str, Any] = {"sentences": len(sentences)}
    decodes: tuple[Decode, ...] = ("greedy", "map")
    for decode in decodes:
        trees = decode_trees(distances, decode)
        scores = uf1_scores([tree_spans(t, include_root=True) for t in trees], sentences)
        out.update({f"{decode}_{k}": scores[k] for k in UF1})
    out.update({f"expected_{k}": v for k, v in expected_scores(distances, sentences).items()})
    out.update({f"sample_{k}": v for k, v in sampled_scores(distances, sentences, samples).items()})
    return out


def parse_baselines(sentences: Sequence[TreebankSentence], seeds: int = 5) -> dict[str, Any]:
    """UF1s of the left / right branching, balanced, random (mean of ``seeds``) trees and of
    the binary upper bound on ``sentences``."""
    lengths = [len(s.words) for s in sentences]
    out: dict[str, Any] = {
        name: uf1_scores([branching_spans(n, kind) for n in lengths], sentences)  # type: ignore[arg-type]
        for name, kind in (("LBRANCH", "left"), ("RBRANCH", "right"), ("BALANCED", "balanced"))
    }
    per_seed = []
    for seed in range(seeds):
        trees = [
            random_spans(n, random.Random(seed * 1_000_003 + i)) for i, n in enumerate(lengths)
        ]
        per_seed.append(uf1_scores(trees, sentences))
    out["RANDOM"] = {k: statistics.mean(r[k] for r in per_seed) for k in per_seed[0]}
    out["UPPER BOUND"] = uf1_scores(
        [binarised_spans(s.spans, len(s.words)) for s in sentences], sentences
    )
    return out
