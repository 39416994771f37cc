"""Prefix -> infix tree transduction data: generator properties, splits, files, vocabulary."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from structattn.data.tree_transduction import (
    Expr,
    GeneratorConfig,
    Pair,
    Vocabulary,
    depth,
    evaluate,
    format_summary,
    generate_splits,
    main_data,
    make_pair,
    parse_infix,
    parse_prefix,
    random_expression,
    read_pairs,
    read_splits,
    source_depth,
    to_infix,
    to_prefix,
    write_splits,
)

PAPER_SOURCE = "( * ( + ( + 15 7 ) 1 8 ) ( + 19 0 11 ) )"
PAPER_TARGET = "( ( 15 + 7 ) + 1 + 8 ) * ( 19 + 0 + 11 )"
SMALL = dict(train_per_depth=40, valid_per_depth=10, test_per_depth=20)


def walk(expr: Expr | int):
    """Every sub-expression, root first."""
    if isinstance(expr, Expr):
        yield expr
        for arg in expr.args:
            yield from walk(arg)


def eval_prefix_stack(tokens: list[str]) -> int:
    """An independent prefix evaluator: a stack of [op, values] frames."""
    stack: list[list] = []
    for i, token in enumerate(tokens):
        if token == "(":
            stack.append([tokens[i + 1], []])
        elif token in "+*" and tokens[i - 1] == "(":
            continue
        elif token == ")":
            op, values = stack.pop()
            value = sum(values) if op == "+" else eval("*".join(map(str, values)))
            if not stack:
                return value
            stack[-1][1].append(value)
        else:
            stack[-1][1].append(int(token))
    raise AssertionError("unbalanced")


def eval_infix_python(tokens: list[str]) -> int:
    """Evaluate the infix with Python: one operator per parenthesised level, so precedence
    agrees with the grouping."""
    text = " ".join(tokens)
    assert re.fullmatch(r"[0-9+*() ]+", text)
    return eval(text, {"__builtins__": {}})


# ----------------------------------------------------------------------------- expressions


def test_paper_example() -> None:
    expr = parse_prefix(PAPER_SOURCE.split())
    assert " ".join(to_infix(expr)) == PAPER_TARGET
    assert " ".join(to_prefix(expr)) == PAPER_SOURCE
    assert depth(expr) == 3 == source_depth(PAPER_SOURCE.split())
    assert parse_infix(PAPER_TARGET.split()) == expr
    assert (
        evaluate(expr)
        == (15 + 7 + 1 + 8) * (19 + 0 + 11)
        == eval_infix_python(PAPER_TARGET.split())
    )
    pair = make_pair(expr)
    assert pair == Pair(tuple(PAPER_SOURCE.split()), tuple(PAPER_TARGET.split()), 3)


def test_infix_layout() -> None:
    assert to_infix(Expr("+", (1, 2))) == ["1", "+", "2"]  # top level bare
    nested = Expr("*", (Expr("+", (1, 2)), 3, Expr("*", (4, 5))))
    assert " ".join(to_infix(nested)) == "( 1 + 2 ) * 3 * ( 4 * 5 )"
    assert depth(3) == 0 and to_prefix(3) == ["3"]


@pytest.mark.parametrize(
    "source, message",
    [
        ("", "empty"),
        ("1", "must start with '('"),
        ("( 1 2 )", "expected an operator"),
        ("(", "expected an operator"),
        ("( - 1 2 )", "expected an operator"),
        ("( + 1 )", "1 operand"),
        ("( + 1 2", "left open"),
        ("( + 1 2 ) )", "after the end"),
        ("( + 1 2 ) 3", "after the end"),
        ("( + 1 x )", "unexpected token 'x'"),
        ("( + 1 07 )", "unexpected token '07'"),
        ("( + 1 -3 )", "unexpected token '-3'"),
        ("( + 1 ( * 2 ) )", "1 operand"),
    ],
)
def test_parse_prefix_errors(source: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_prefix(source.split())


@pytest.mark.parametrize(
    "target, message",
    [
        ("", "incomplete"),
        ("1", "incomplete"),
        ("( 1 + 2 )", "incomplete"),  # the top level is not parenthesised
        ("1 + 2 * 3", "mixed operators"),
        ("1 + + 2", "expected an operand"),
        ("1 2", "expected an operator"),
        ("1 + ( 2 + 3", "left open"),
        ("1 + 2 )", "unbalanced ')'"),
        ("1 + ( )", "expected an operand"),
        ("1 + ( 2 )", "incomplete"),
        ("1 +", "incomplete"),
        ("1 + x", "unexpected token 'x'"),
    ],
)
def test_parse_infix_errors(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_infix(target.split())


def test_expr_validation() -> None:
    for op, args in (("-", (1, 2)), ("+", (1,)), ("+", [1, 2]), ("+", (1, -2)), ("+", (1, True))):
        with pytest.raises(ValueError):
            Expr(op, args)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- generator


@pytest.mark.parametrize("d", [1, 2, 3, 4, 5, 6])
def test_generator_properties(d: int) -> None:
    config = GeneratorConfig()
    for seed in range(60):
        expr = random_expression(d, random.Random(seed), config)
        source, target = to_prefix(expr), to_infix(expr)
        assert depth(expr) == d == source_depth(source)
        assert source_depth(target) == d - 1
        assert len(source) <= config.max_source_length
        for sub in walk(expr):
            assert 2 <= len(sub.args) <= 4
            assert sub.op in ("+", "*")
            for arg in sub.args:
                assert isinstance(arg, Expr) or 0 <= arg <= 20
            # the depth is exact at every level: some operand is exactly one level shallower
            assert max(depth(a) for a in sub.args) == depth(sub) - 1
        assert set(source) <= {"(", ")", "+", "*"} | {str(n) for n in range(21)}
        # round trips and arithmetic agreement, by three independent evaluators
        assert parse_prefix(source) == expr == parse_infix(target)
        assert evaluate(expr) == eval_prefix_stack(source) == eval_infix_python(target)


def test_generator_covers_the_alphabet() -> None:
    rng = random.Random(0)
    ops, counts, numbers = Counter(), Counter(), Counter()
    for _ in range(300):
        for sub in walk(random_expression(3, rng)):
            ops[sub.op] += 1
            counts[len(sub.args)] += 1
            numbers.update(a for a in sub.args if isinstance(a, int))
    assert set(ops) == {"+", "*"} and set(counts) == {2, 3, 4} and set(numbers) == set(range(21))
    assert 0.4 < ops["+"] / sum(ops.values()) < 0.6


def test_generator_config() -> None:
    config = GeneratorConfig(max_operands=2, max_number=3, operators=("*",), subexpr_prob=0.0)
    expr = random_expression(4, random.Random(1), config)
    assert len(to_prefix(expr)) == config.min_source_length(4) == 17  # a bare chain
    assert {s.op for s in walk(expr)} == {"*"}
    with pytest.raises(ValueError, match="max_source_length"):
        random_expression(50, random.Random(0))  # 50 levels need 201 > 200 tokens
    with pytest.raises(RuntimeError, match="max_source_length=200"):
        random_expression(40, random.Random(0))  # possible (161 tokens) but too unlikely
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="depth"):
            random_expression(bad, random.Random(0))  # type: ignore[arg-type]
    for kwargs in (
        dict(min_operands=1),
        dict(min_operands=3, max_operands=2),
        dict(max_number=-1),
        dict(operators=("-",)),
        dict(operators=()),
        dict(subexpr_prob=1.5),
        dict(max_source_length=0),
    ):
        with pytest.raises(ValueError):
            GeneratorConfig(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- splits


def test_full_size_splits() -> None:
    """The paper's sizes (about 0.5 s): 15K train at depth 2-4, 1K test at 2-6, 500 valid."""
    splits = generate_splits(0)
    assert list(splits) == ["train", "valid", "test"]
    per_depth = {name: Counter(p.depth for p in pairs) for name, pairs in splits.items()}
    assert per_depth["train"] == {2: 5000, 3: 5000, 4: 5000}
    assert per_depth["test"] == {d: 200 for d in range(2, 7)}
    assert per_depth["valid"] == {d: 100 for d in range(2, 7)}
    sources = {name: {p.source for p in pairs} for name, pairs in splits.items()}
    for name, pairs in splits.items():
        assert len(sources[name]) == len(pairs), f"duplicate source in {name}"
    assert not sources["train"] & sources["valid"]
    assert not sources["train"] & sources["test"]
    assert not sources["valid"] & sources["test"]
    for pairs in splits.values():
        for pair in pairs[:: len(pairs) // 50]:  # a sample: the pair is the formula's
            assert make_pair(parse_prefix(pair.source)) == pair
    # valid and test are ordered by depth, train is shuffled
    assert [p.depth for p in splits["test"]] == sorted(p.depth for p in splits["test"])
    assert [p.depth for p in splits["train"][:30]] != sorted(p.depth for p in splits["train"][:30])


def test_splits_seeded() -> None:
    first, again = generate_splits(3, **SMALL), generate_splits(3, **SMALL)
    assert first == again
    assert generate_splits(4, **SMALL)["test"] != first["test"]
    # the test split does not depend on the other splits' sizes
    other = generate_splits(3, train_per_depth=5, valid_per_depth=0, test_per_depth=20)
    assert other["test"] == first["test"] and other["valid"] == []


def test_splits_dedupe_under_pressure() -> None:
    """A tiny formula space forces redraws: still no duplicate within or across splits."""
    tiny = GeneratorConfig(max_operands=2, max_number=1, operators=("+",))  # 4 depth-1 formulas
    splits = generate_splits(
        0, train_per_depth=2, train_depths=(1,), valid_per_depth=1, valid_depths=(1,),
        test_per_depth=1, test_depths=(1,), config=tiny,
    )  # fmt: skip
    sources = [p.source for pairs in splits.values() for p in pairs]
    assert len(sources) == len(set(sources)) == 4
    with pytest.raises(RuntimeError, match="distinct unseen sources"):
        generate_splits(0, train_per_depth=5, train_depths=(1,), valid_per_depth=0,
                        test_per_depth=0, config=tiny)  # fmt: skip
    with pytest.raises(ValueError, match="train_per_depth"):
        generate_splits(0, train_per_depth=-1)


# ----------------------------------------------------------------------------- files


def test_write_and_read(tmp_path: Path) -> None:
    splits = generate_splits(1, **SMALL)
    config = GeneratorConfig()
    paths = write_splits(splits, tmp_path / "a", seed=1, config=config)
    assert {p.name for p in (tmp_path / "a").iterdir()} == {
        "train.tsv",
        "valid.tsv",
        "test.tsv",
        "meta.json",
    }  # no temporary files left
    (tmp_path / "plain").write_text("x")  # permissions follow the umask, as for any file
    assert paths["train"].stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert read_splits(tmp_path / "a") == splits
    assert read_pairs(paths["train"]) == splits["train"]
    line = paths["test"].read_text(encoding="utf-8").splitlines()[0]
    source, target = line.split("\t")
    assert source == " ".join(splits["test"][0].source) and not source.startswith("$")
    meta = json.loads(paths["meta"].read_text(encoding="utf-8"))
    assert meta["seed"] == 1 and meta["generator_config"]["max_number"] == 20
    assert meta["counts_per_depth"]["test"] == {str(d): 20 for d in range(2, 7)}
    # same seed -> identical files; another seed -> different files
    write_splits(generate_splits(1, **SMALL), tmp_path / "b", seed=1, config=config)
    write_splits(generate_splits(2, **SMALL), tmp_path / "c", seed=2, config=config)
    for name in ("train.tsv", "valid.tsv", "test.tsv", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    with pytest.raises(ValueError, match="split name"):
        write_splits({"../x": []}, tmp_path)
    with pytest.raises(FileNotFoundError, match="valid.tsv"):
        (tmp_path / "a" / "valid.tsv").unlink()
        read_splits(tmp_path / "a")


def test_read_any_file_in_the_format(tmp_path: Path) -> None:
    path = tmp_path / "free.tsv"
    path.write_text("a b\tc\n( ( x\ty z\n\n\n", encoding="utf-8")  # blank lines at the end: ok
    assert read_pairs(path) == [
        Pair(("a", "b"), ("c",), 0),
        Pair(("(", "(", "x"), ("y", "z"), 2),
    ]
    (tmp_path / "no_newline.tsv").write_text("1\t2", encoding="utf-8")
    assert read_pairs(tmp_path / "no_newline.tsv") == [Pair(("1",), ("2",), 0)]
    for text in ("", "\n\n"):  # empty or blank: a cut copy, no longer read as no pairs (#37)
        (tmp_path / "empty.tsv").write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=r"empty\.tsv: empty file .*structattn data tree"):
            read_pairs(tmp_path / "empty.tsv")


GOOD = "( + 1 2 )\t1 + 2\n"


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("( + 1 2 ) 1 + 2\n", "found no tab"),
        ("( + 1 2 )\t1 + 2\textra\n", "found 2 tabs"),
        ("\t1 + 2\n", "empty source"),
        ("( + 1 2 )\t\n", "empty target"),
        (" ( + 1 2 )\t1 + 2\n", "leading or trailing space in the source"),
        ("( + 1 2 ) \t1 + 2\n", "leading or trailing space in the source"),
        ("( + 1 2 )\t1 + 2 \n", "leading or trailing space in the target"),
        ("( + 1  2 )\t1 + 2\n", "more than one space between tokens of the source"),
        ("( + 1 2 )\t1 +  2\n", "more than one space between tokens of the target"),
        ("( + 1 2 )\t1 + 2\r\n", "Windows line ending"),
        ("( + 1\x0b2 )\t1 + 2\n", "whitespace other than single spaces in the source"),
        ("\n", "empty line"),
        (" \n", "found no tab"),
    ],
)
def test_read_pairs_errors(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "bad.tsv"
    path.write_bytes((GOOD * 2 + bad_line + GOOD).encode("utf-8"))
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message)):
        read_pairs(path)


def test_read_pairs_bad_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.tsv"
    path.write_bytes(GOOD.encode() + b"( + 1 2 )\t1 \xe9 2\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not valid UTF-8")):
        read_pairs(path)


def test_main_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main_data(str(tmp_path / "out"), seed=5, train_per_depth=10, valid_per_depth=2,
              test_per_depth=3)  # fmt: skip
    out = capsys.readouterr().out
    assert "test" in out and "meta.json" in out
    splits = read_splits(tmp_path / "out")
    assert len(splits["train"]) == 30 and len(splits["test"]) == 15
    assert format_summary(splits).splitlines()[0].split()[:3] == ["split", "depth", "pairs"]


# ----------------------------------------------------------------------------- vocabulary


def test_vocabulary() -> None:
    splits = generate_splits(0, **SMALL)
    vocab = Vocabulary.build(splits["train"])
    assert vocab.tokens[:5] == ("<pad>", "<unk>", "<s>", "</s>", "$")
    assert (vocab.pad_id, vocab.unk_id, vocab.bos_id, vocab.eos_id, vocab.root_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert vocab.tokens[5:] == ("(", ")", "*", "+", *map(str, range(21)))
    assert len(vocab) == 30 and "$" in vocab and "7" in vocab and "-" not in vocab
    for pair in splits["test"]:
        assert vocab.decode(vocab.encode(pair.source)) == list(pair.source)
    assert vocab.encode(["$", "(", "-", "21", ")"]) == [4, 5, 1, 1, 6]
    assert vocab.decode([4, 5, 1]) == ["$", "(", "<unk>"]
    assert vocab.decode(torch.tensor([4, 5])) == ["$", "("]
    with pytest.raises(ValueError, match="out of range"):
        vocab.decode([30])
    # JSON round trip (plain lists/dicts of str and int only)
    state = json.loads(json.dumps(vocab.to_dict()))
    assert Vocabulary.from_dict(state) == vocab
    with pytest.raises(ValueError):
        Vocabulary.from_dict({"kind": "other", "version": 1, "tokens": list(vocab.tokens)})
    with pytest.raises(ValueError, match="must start with"):
        Vocabulary(("a", "b"))
    with pytest.raises(ValueError, match="duplicate"):
        Vocabulary((*Vocabulary.SPECIALS, "a", "a"))
    rare = Vocabulary.build([Pair(("a", "b"), ("a",), 0)], min_count=2)
    assert rare.tokens[5:] == ("a",)


def test_encode_batch() -> None:
    vocab = Vocabulary.build([make_pair(parse_prefix(PAPER_SOURCE.split()))])
    ids, lengths = vocab.encode_batch([["(", "+", "1", "8", ")"], ["7"]], add_root=True)
    assert ids.dtype == torch.long and ids.shape == (2, 6)
    assert lengths.tolist() == [6, 2]
    assert ids[1].tolist() == [vocab.root_id, vocab.encode(["7"])[0], 0, 0, 0, 0]
    ids, lengths = vocab.encode_batch([["1"]], add_bos=True, add_eos=True)
    assert ids.tolist() == [[vocab.bos_id, vocab.encode(["1"])[0], vocab.eos_id]]
