"""Empty or truncated data files (#37.3.7): every reader raises a ValueError naming the file,
what it expected and, for a data set ``structattn download`` fetches, the command that
fetches it again, instead of returning no examples that a recipe would train or score on;
and the recipes refuse an empty split."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from structattn.data import babi, classification, conllu, embeddings, lm, parallel, synthetic
from structattn.data import tree_transduction as tt
from structattn.io import check_splits, empty_file_error

# (file name, reader, what the error says it expected, the download name or the fix)
READERS: list[tuple[str, Callable[[Path], Any], str, str]] = [
    ("qa1_x_train.txt", babi.read_babi, "bAbI lines", "structattn download babi"),
    ("SICK.txt", classification.read_sick, "SICK's header", "structattn download sick"),
    ("snli.jsonl", classification.read_snli_jsonl, "JSON object", "structattn download snli"),
    ("train.txt", classification.read_sst, "SST trees", "structattn download sst"),
    ("a.conllu", conllu.read_conllu, "CoNLL-U", "structattn download ud_english_ewt"),
    ("train.en", parallel.read_lines, "one sentence per line", "small_parallel_enja"),
    ("count.tsv", synthetic.read_counting, "BITS<TAB>COUNT", "structattn data mfa"),
    ("sort.tsv", synthetic.read_sorting, "<TAB>y1", "structattn data mfa"),
    ("valid.tsv", tt.read_pairs, "source<TAB>target", "structattn data tree-transduction"),
    ("ptb.valid.txt", lm.read_lm_lines, "empty corpus file", "structattn download ptb"),
    ("glove.txt", embeddings.read_word_vectors, "empty file", "structattn download glove"),
]


@pytest.mark.parametrize("name, reader, expected, fix", READERS, ids=[r[0] for r in READERS])
def test_an_empty_file_names_itself_and_the_fix(
    tmp_path: Path, name: str, reader: Callable[[Path], Any], expected: str, fix: str
) -> None:
    """Each of these returned [] for an empty file (the LM and GloVe readers already said
    "empty", without the fix)."""
    path = tmp_path / name
    path.write_text("")
    with pytest.raises(ValueError) as error:
        reader(path)
    message = str(error.value)
    assert message.startswith(str(path)) and expected in message and fix in message, message


@pytest.mark.parametrize(
    "name, reader",
    [
        ("qa1_x_train.txt", babi.read_babi),
        ("a.conllu", conllu.read_conllu),
        ("count.tsv", synthetic.read_counting),
        ("valid.tsv", tt.read_pairs),
        ("ptb.valid.txt", lm.read_lm_lines),
    ],
)
def test_a_file_of_blank_lines_is_empty_too(
    tmp_path: Path, name: str, reader: Callable[[Path], Any]
) -> None:
    path = tmp_path / name
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: (empty file|no words)"):
        reader(path)


def test_sick_with_only_its_header(tmp_path: Path) -> None:
    path = tmp_path / "SICK.txt"
    path.write_text(
        "pair_ID\tsentence_A\tsentence_B\tentailment_label\trelatedness_score\tSemEval_set\n"
    )
    with pytest.raises(ValueError, match="no sentence pairs after the header.*download sick"):
        classification.read_sick(path)


def test_snli_parallel_files(tmp_path: Path) -> None:
    for name in ("s1", "s2", "labels"):
        (tmp_path / f"{name}.dev").write_text("")
    with pytest.raises(ValueError, match=r"s1\.dev: empty file .*download snli_devtest"):
        classification.read_snli(tmp_path, "dev")


def test_treebank_file(tmp_path: Path) -> None:
    pytest.importorskip("nltk", reason="nltk reads the .mrg trees (pip install nltk)")
    from structattn.data import treebank

    path = tmp_path / "wsj_0001.mrg"
    path.write_text("")
    with pytest.raises(ValueError, match=r"wsj_0001\.mrg: empty file .*nltk_treebank_sample"):
        treebank.read_mrg(path)


def test_where_empty_is_legitimate() -> None:
    """A text (not a file) may hold nothing: the string parsers keep returning []."""
    assert conllu.parse_conllu("") == []
    assert babi.parse_babi_lines([]) == []


def test_the_helpers() -> None:
    error = empty_file_error("x/y.txt", "lines", "ptb")
    assert str(error) == (
        "x/y.txt: empty file (expected lines); a cut download or copy? `structattn download "
        "ptb` fetches it again"
    )
    assert str(empty_file_error("x", "lines")) == "x: empty file (expected lines)"
    check_splits({"train": [1], "valid": [2]}, "here")
    check_splits({"train": [1], "valid": []}, "here", optional=("valid",))
    with pytest.raises(ValueError, match="^here: the valid split is empty"):
        check_splits({"train": [1], "valid": [], "test": []}, "here")


# ---- recipes refuse an empty split ---------------------------------------------------------
def test_nmt_refuses_a_split_the_length_filter_empties(tmp_path: Path) -> None:
    from structattn.recipes import nmt

    for stem in ("train", "dev", "test"):
        (tmp_path / f"{stem}.ja").write_text("a b\n")
        (tmp_path / f"{stem}.en").write_text("c d\n")
    (tmp_path / "dev.en").write_text(" ".join(["w"] * 90) + "\n")  # too long: filtered out
    config = nmt.NMTConfig(data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="the valid split is empty"):
        nmt.load_data(config)


def test_babi_refuses_an_empty_validation_split_unless_asked(tmp_path: Path) -> None:
    from structattn.recipes import babi as recipe

    story = "1 Mary went to the hallway.\n2 Where is Mary?\thallway\t1\n"
    (tmp_path / "qa1_single-supporting-fact_train.txt").write_text(story)
    (tmp_path / "qa1_single-supporting-fact_test.txt").write_text(story)
    asked = recipe.BabiConfig(data_dir=str(tmp_path), task=1, valid_fraction=0.0)
    splits, _ = recipe.load_data(asked)
    assert splits["valid"] == [] and len(splits["train"]) == 1
    # 10% of one question rounds to none held out: an empty validation split, refused
    rounded = recipe.BabiConfig(data_dir=str(tmp_path), task=1, valid_fraction=0.1)
    with pytest.raises(ValueError, match="bAbI task 1: the valid split is empty"):
        recipe.load_data(rounded)


def test_mfa_refuses_an_empty_split(tmp_path: Path) -> None:
    from structattn.recipes import mfa

    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.tsv").write_text("0110\t1\n")
    config = mfa.MFAConfig(task="counting", data_dir=str(tmp_path))
    assert len(mfa.load_data(config)["valid"]) == 1
    (tmp_path / "valid.tsv").write_text("")
    with pytest.raises(ValueError, match=r"valid\.tsv: empty file"):
        mfa.load_data(config)


def test_sst_binary_refuses_a_split_of_only_neutral_trees(tmp_path: Path) -> None:
    """read_sst of a file of neutral trees gives [] for the binary task (the file was read,
    every tree dropped): the recipe refuses the empty split."""
    from structattn.recipes import lstmn_sst

    (tmp_path / "train.txt").write_text("(4 (3 good) (2 film))\n")
    (tmp_path / "dev.txt").write_text("(2 (2 a) (2 film))\n")
    (tmp_path / "test.txt").write_text("(0 (0 bad) (2 film))\n")
    assert classification.read_sst(tmp_path / "dev.txt", "binary") == []
    config = lstmn_sst.LSTMNSSTConfig(data_dir=str(tmp_path), task="binary")
    with pytest.raises(ValueError, match="SST \\(binary\\) in .*: the valid split is empty"):
        lstmn_sst.load_splits(config)
