"""``structattn download``: mirrors built here (folders, upstream-style tar.gz / zip archives,
file:// URLs), checksums, cut and resumed downloads, path traversal, and the shipped manifest
against ../shared/data's SOURCE.md files. No test touches the network."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest

from structattn.cli import main
from structattn.data import download as dl
from structattn.io import data_dir

TAR_FILES = {"tasks/en/a.txt": b"alpha\n" * 50, "tasks/en/sub/b.txt": b"beta\n" * 70}
ZIP_FILES = {"z/c.txt": b"gamma\n" * 30, "z/big.txt": b"".join(b"w%d 0.1\n" % i for i in range(40))}
PLAIN = b"delta\n" * 10


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _entry(path: str, member: str | None, data: bytes, pinned: bool = True) -> dict[str, Any]:
    sha = _sha(data) if pinned else None
    return {"path": path, "member": member, "size": len(data) if pinned else None, "sha256": sha}


def _toy_manifest(tmp_path: Path, unpinned: bool = False, path: str = "a.txt") -> Path:
    """A manifest of one data set ``toy`` from a tar.gz, a zip (one file cut to its first 10
    lines) and a plain file; ``unpinned``: the plain file has no sha256."""
    head = b"".join(ZIP_FILES["z/big.txt"].splitlines(keepends=True)[:10])
    big = {**_entry("big.10.txt", "z/big.txt", head), "head_lines": 10}
    toy = {
        "folder": "toy",
        "description": "a toy data set",
        "licence": "research only (toy)",
        "recipes": ["babi"],
        "sources": [
            {
                "url": "https://example.invalid/dl/toy.tar.gz",
                "format": "tar.gz",
                "sha256": None,
                "size": None,
                "files": [
                    _entry(path, "tasks/en/a.txt", TAR_FILES["tasks/en/a.txt"]),
                    _entry("sub/b.txt", "./tasks/en/sub/b.txt", TAR_FILES["tasks/en/sub/b.txt"]),
                ],
            },
            {
                "url": "https://example.invalid/dl/toy.zip",
                "format": "zip",
                "sha256": None,
                "size": None,
                "files": [_entry("c.txt", "z/c.txt", ZIP_FILES["z/c.txt"]), big],
            },
            {
                "url": "https://example.invalid/raw/d.txt",
                "format": "plain",
                "sha256": None,
                "size": None,
                "files": [_entry("d.txt", None, PLAIN, pinned=not unpinned)],
            },
        ],
    }
    out = tmp_path / "manifest.json"
    out.write_text(json.dumps({"datasets": {"toy": toy}}))
    return out


def _use(monkeypatch: pytest.MonkeyPatch, manifest: Path) -> dict[str, dl.DataSet]:
    sets = dl.load_manifest(manifest)
    monkeypatch.setattr(dl, "manifest", lambda: sets)
    return sets


def _archives(folder: Path, tar_extra: dict[str, bytes] | None = None) -> Path:
    """Upstream-style archives of the toy data set in ``folder``, by file name."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "toy.tar.gz", "w:gz") as tar:
        for name, data in {**TAR_FILES, **(tar_extra or {})}.items():
            info = tarfile.TarInfo(name if name != "tasks/en/sub/b.txt" else f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with zipfile.ZipFile(folder / "toy.zip", "w") as archive:
        for name, data in ZIP_FILES.items():
            archive.writestr(name, data)
    (folder / "d.txt").write_bytes(PLAIN)
    return folder


def _expected() -> dict[str, bytes]:
    head = b"".join(ZIP_FILES["z/big.txt"].splitlines(keepends=True)[:10])
    return {
        "a.txt": TAR_FILES["tasks/en/a.txt"],
        "sub/b.txt": TAR_FILES["tasks/en/sub/b.txt"],
        "c.txt": ZIP_FILES["z/c.txt"],
        "big.10.txt": head,
        "d.txt": PLAIN,
    }


def _installed(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not p.name.endswith(".sha256")
    }


@pytest.fixture()
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, dl.DataSet]:
    monkeypatch.delenv("STRUCTATTN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # never the real cache
    return _use(monkeypatch, _toy_manifest(tmp_path))


@pytest.mark.parametrize("as_url", [False, True], ids=["folder", "file-url"])
def test_archives_from_a_mirror(toy: Any, tmp_path: Path, as_url: bool, capsys: Any) -> None:
    mirror = _archives(tmp_path / "mirror")
    source = mirror.as_uri() if as_url else str(mirror)
    folder = dl.download("toy", tmp_path / "root", source)
    assert folder == tmp_path / "root" / "toy"
    assert _installed(folder) == _expected()  # only the manifest's members, cut where asked
    out = capsys.readouterr().out
    assert "Licence: research only (toy)" in out and "5 file(s) installed" in out
    assert not (tmp_path / "root" / ".downloads").exists() or not any(
        (tmp_path / "root" / ".downloads").iterdir()
    )  # archives removed once installed
    dl.download("toy", tmp_path / "root", source)
    assert "already present and verified" in capsys.readouterr().out


def test_folder_mirror_laid_out_like_shared_data(toy: Any, tmp_path: Path) -> None:
    layout = tmp_path / "shared" / "toy"
    for name, data in _expected().items():
        (layout / name).parent.mkdir(parents=True, exist_ok=True)
        (layout / name).write_bytes(data)
    for source in (tmp_path / "shared", layout):  # the root, or the data set's own folder
        root = tmp_path / f"root-{source.name}"
        assert _installed(dl.download("toy", root, str(source))) == _expected()


def test_a_corrupted_file_installs_nothing(toy: Any, tmp_path: Path) -> None:
    layout = tmp_path / "shared" / "toy"
    for name, data in _expected().items():
        (layout / name).parent.mkdir(parents=True, exist_ok=True)
        (layout / name).write_bytes(data)
    bad = bytearray(_expected()["c.txt"])
    bad[3] ^= 1
    (layout / "c.txt").write_bytes(bytes(bad))
    root = tmp_path / "root"
    with pytest.raises(dl.DownloadError) as error:
        dl.download("toy", root, str(tmp_path / "shared"))
    message = str(error.value)
    assert str(root / "toy" / "c.txt") in message
    assert _sha(_expected()["c.txt"]) in message and _sha(bytes(bad)) in message
    assert "nothing installed" in message
    assert not any(p.is_file() for p in (root / "toy").rglob("*"))  # not even the good files


def test_a_corrupted_archive_member_installs_nothing(toy: Any, tmp_path: Path) -> None:
    mirror = _archives(tmp_path / "mirror")
    with zipfile.ZipFile(mirror / "toy.zip", "w") as archive:  # c.txt changed upstream
        archive.writestr("z/c.txt", b"changed\n")
        archive.writestr("z/big.txt", ZIP_FILES["z/big.txt"])
    assert main(["download", "toy", "--data-dir", str(tmp_path / "root"), "--from", str(mirror)])
    assert not any(p.is_file() for p in (tmp_path / "root" / "toy").rglob("*"))


def test_a_bad_downloaded_archive_is_fetched_again(
    toy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror = _archives(tmp_path / "mirror")
    files = {p.name: p.read_bytes() for p in mirror.iterdir()}
    good = files["toy.zip"]
    files["toy.zip"] = files["toy.zip"].replace(b"gamma", b"GAMMA")  # a stored member changed
    seen = _server(monkeypatch, files, ranges=True)
    root = tmp_path / "root"
    errors = []
    for _ in range(3):  # the first answer of each file is cut once
        with pytest.raises(dl.DownloadError) as error:
            dl.download("toy", root)
        errors.append(str(error.value))
    assert "toy.zip is not a valid zip archive" in errors[-1]  # one line, no traceback
    assert not (root / ".downloads" / "toy.zip").exists()  # not reused
    files["toy.zip"] = good
    for _ in range(3):  # d.txt's first answer is cut too
        with contextlib.suppress(dl.DownloadError):
            dl.download("toy", root)
    assert _installed(root / "toy") == _expected()
    assert len(seen) >= 5


class _Response(io.BytesIO):
    """What urlopen returns: a status, headers and the body (maybe cut after ``cut`` bytes)."""

    def __init__(self, body: bytes, status: int, cut: int | None = None) -> None:
        super().__init__(body)
        self.status, self.cut = status, cut
        self.headers = {"Content-Length": str(len(body))}

    def read(self, size: int | None = -1) -> bytes:
        if self.cut is not None and self.tell() >= self.cut:
            raise ConnectionResetError("connection reset by peer")
        limit = size if size is not None and size >= 0 else len(self.getvalue())
        if self.cut is not None:
            limit = min(limit, self.cut - self.tell())
        return super().read(limit)


def _server(monkeypatch: pytest.MonkeyPatch, files: dict[str, bytes], ranges: bool) -> list[str]:
    """Fake ``urlopen`` serving ``files`` by URL name; the first answer of each file is cut
    half-way; ``ranges``: honour ``Range``. Returns the Range headers seen."""
    seen: list[str] = []
    served: set[str] = set()

    def urlopen(request: urllib.request.Request, timeout: float = 0) -> _Response:
        name = request.full_url.rsplit("/", 1)[1]
        body = files[name]
        asked = request.get_header("Range")
        seen.append(asked or "")
        cut = len(body) // 2 if name not in served else None
        served.add(name)
        if asked and ranges:
            start = int(asked.split("=")[1].rstrip("-"))
            return _Response(body[start:], 206, cut)
        return _Response(body, 200, cut)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return seen


@pytest.mark.parametrize("ranges", [True, False], ids=["resumed", "restarted"])
def test_a_cut_download_resumes(
    toy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranges: bool
) -> None:
    mirror = _archives(tmp_path / "mirror")
    files = {p.name: p.read_bytes() for p in mirror.iterdir()}
    seen = _server(monkeypatch, files, ranges)
    root = tmp_path / "root"
    with pytest.raises(dl.DownloadError, match="toy.tar.gz: connection reset"):
        dl.download("toy", root)
    part = root / ".downloads" / "toy.tar.gz.part"
    assert part.is_file() and 0 < part.stat().st_size < len(files["toy.tar.gz"])
    assert not any(p.is_file() for p in (root / "toy").rglob("*"))  # no half file anywhere
    for _ in range(3):  # each source's first answer is cut once
        try:
            dl.download("toy", root)
            break
        except dl.DownloadError:
            pass
    assert _installed(root / "toy") == _expected()
    assert f"bytes={len(files['toy.tar.gz']) // 2}-" in seen
    assert not part.exists()


def test_offline_error_names_the_data_set_url_and_fix(
    toy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    def offline(request: urllib.request.Request, timeout: float = 0) -> None:
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    assert main(["download", "toy", "--data-dir", str(tmp_path / "root")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("structattn: error: could not download data set 'toy'")
    assert "https://example.invalid/dl/toy.tar.gz" in err and "Name or service not known" in err
    assert "--from" in err and "STRUCTATTN_DATA" in err


def test_present_files_are_skipped_unless_forced(toy: Any, tmp_path: Path, capsys: Any) -> None:
    mirror = str(_archives(tmp_path / "mirror"))
    folder = dl.download("toy", tmp_path / "root", mirror)
    before = (folder / "a.txt").stat().st_ino
    dl.download("toy", tmp_path / "root", mirror)
    assert (folder / "a.txt").stat().st_ino == before
    dl.download("toy", tmp_path / "root", mirror, force=True)
    assert (folder / "a.txt").stat().st_ino != before  # written again
    (folder / "c.txt").write_bytes(b"tampered")  # a bad file is not "present"
    capsys.readouterr()
    dl.download("toy", tmp_path / "root", mirror)
    assert "1 file(s) installed" in capsys.readouterr().out
    assert _installed(folder) == _expected()


def test_unpinned_files_warn_and_record_their_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    _use(monkeypatch, _toy_manifest(tmp_path, unpinned=True))
    mirror = str(_archives(tmp_path / "mirror"))
    folder = dl.download("toy", tmp_path / "root", mirror)
    err = capsys.readouterr().err
    assert f"WARNING: {folder / 'd.txt'} is unpinned" in err and _sha(PLAIN) in err
    assert (folder / "d.txt.sha256").read_text().split()[0] == _sha(PLAIN)
    dl.download("toy", tmp_path / "root", mirror)
    assert "already present" in capsys.readouterr().out  # verified against the record


@pytest.mark.parametrize("path", ["../escape.txt", "/abs.txt", "a/../../b.txt", "C:x.txt"])
def test_unsafe_manifest_paths_are_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(dl.DownloadError, match="unsafe path"):
        dl.load_manifest(_toy_manifest(tmp_path, path=path))


def test_archive_members_outside_the_manifest_are_never_written(toy: Any, tmp_path: Path) -> None:
    evil = {"../../escape.txt": b"x", "/tmp/abs.txt": b"y"}
    mirror = _archives(tmp_path / "mirror", tar_extra=evil)
    dl.download("toy", tmp_path / "a" / "root", str(mirror))
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "a" / "escape.txt").exists()


def test_a_link_member_is_refused(toy: Any, tmp_path: Path) -> None:
    mirror = _archives(tmp_path / "mirror")
    with tarfile.open(mirror / "toy.tar.gz", "w:gz") as tar:
        link = tarfile.TarInfo("tasks/en/a.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(dl.DownloadError, match="no regular file member 'tasks/en/a.txt'"):
        dl.download("toy", tmp_path / "root", str(mirror))
    assert not any(p.is_file() for p in (tmp_path / "root" / "toy").rglob("*"))


def test_cli_download_then_the_data_rule_finds_it(
    toy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    root = tmp_path / "data"
    monkeypatch.setenv("STRUCTATTN_DATA", str(root))
    mirror = _archives(tmp_path / "mirror")
    assert main(["download", "toy", "--from", str(mirror)]) == 0  # default root: STRUCTATTN_DATA
    assert data_dir("toy", what="toy") == (root / "toy").resolve()
    assert main(["download", "--list"]) == 0
    assert "toy [present]: a toy data set" in capsys.readouterr().out
    assert main(["download", "nothing"]) == 1
    assert "no data set 'nothing'" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="`structattn download absent`"):
        data_dir("absent", what="absent")  # the rule's error says how to fetch a data set


# ---- the shipped manifest and real data sets ------------------------------------------------
def test_shipped_manifest_is_well_formed() -> None:
    sets = dl.load_manifest()
    assert {"babi", "ptb", "wikitext-2", "ud_english_ewt", "sst", "sick", "snli_devtest",
            "snli", "small_parallel_enja", "nltk_treebank_sample", "glove",
            "glove-840b-300d"} <= set(sets)  # fmt: skip
    for ds in sets.values():
        for kept in ds.files:
            assert (kept.sha256 is None) == (kept.size is None), (ds.name, kept.path)
            assert kept.sha256 is None or re.fullmatch("[0-9a-f]{64}", kept.sha256)
        assert all(s.format == "plain" or all(k.member for k in s.files) for s in ds.sources)
    unpinned = {name for name, ds in sets.items() if not ds.pinned}
    assert unpinned == {"snli", "glove-6b-50d", "glove-840b-300d"}  # never here: no hash known
    for name in ("sst", "sick", "ptb", "nltk_treebank_sample", "wikitext-2", "ud_english_ewt"):
        licence = sets[name].licence
        assert "research" in licence or "ShareAlike" in licence, name


ALL_SETS = ("babi", "glove", "nltk_treebank_sample", "ptb", "sick", "small_parallel_enja",
            "snli_devtest", "sst", "ud_english_ewt", "wikitext-2")  # fmt: skip


@pytest.mark.data(*ALL_SETS)
def test_manifest_matches_the_data_and_its_source_files() -> None:
    """Every pinned file's sha256 and size equal the SOURCE.md table and the file itself."""
    sets = dl.load_manifest()
    for name in ALL_SETS:
        ds = sets[name]
        folder = data_dir(ds.folder, what=name)
        for kept in ds.files:
            path = folder / kept.path
            assert (path.stat().st_size, dl.file_sha256(path)) == (kept.size, kept.sha256), path
        source = folder / "SOURCE.md"
        if source.is_file():  # ../shared/data (a downloaded copy has none)
            text = source.read_text(encoding="utf-8")
            table = re.findall(r"^\| (\S+) \| (\d+) \| [^|]* \| `([0-9a-f]{64})` \|$", text, re.M)
            if not table:  # glove: one file described in a sentence
                table = re.findall(r"`(\S+)` — ([\d,]+) bytes, .*sha256 `([0-9a-f]{64})`", text)
            listed = {p: (int(size.replace(",", "")), sha) for p, size, sha in table}
            assert listed == {k.path: (k.size, k.sha256) for k in ds.files}, name


@pytest.mark.data("babi")
def test_babi_from_an_upstream_style_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real bAbI files packed as tasks_1-20_v1-2.tar.gz (plus files the download must
    leave out), downloaded by the shipped manifest and read by the bAbI loader."""
    from structattn.data.babi import default_data_dir

    source = data_dir("babi", "en", what="bAbI")
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    with tarfile.open(mirror / "tasks_1-20_v1-2.tar.gz", "w:gz") as tar:
        for path in sorted(source.glob("qa*_*.txt")):
            tar.add(path, f"tasks_1-20_v1-2/en/{path.name}")
        tar.add(next(source.glob("qa1_*train.txt")), "tasks_1-20_v1-2/en-10k/qa1_x.txt")
    root = tmp_path / "data"
    monkeypatch.setenv("STRUCTATTN_DATA", str(root))
    assert main(["download", "babi", "--from", str(mirror)]) == 0
    assert default_data_dir() == (root / "babi" / "en").resolve()
    assert len(list((root / "babi" / "en").iterdir())) == 40
    assert not (root / "babi" / "en-10k").exists()


@pytest.mark.data("ptb")
@pytest.mark.parametrize("layout", ["folder", "archive"])
def test_download_ptb_then_the_loader_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, capsys: Any
) -> None:
    """The issue's done-criterion: `structattn download ptb --from <mirror>` into an empty
    STRUCTATTN_DATA, then the PTB loader finds it there."""
    from structattn.data.lm import corpus_files, default_lm_data_dir

    source = data_dir("ptb", what="PTB")
    mirror = tmp_path / "mirror"
    if layout == "folder":
        shutil.copytree(source, mirror / "ptb")
    else:
        mirror.mkdir()
        with tarfile.open(mirror / "simple-examples.tgz", "w:gz") as tar:
            for name in ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"):
                tar.add(source / name, f"./simple-examples/data/{name}")
    root = tmp_path / "empty"
    root.mkdir()
    monkeypatch.setenv("STRUCTATTN_DATA", str(root))
    assert main(["download", "ptb", "--from", str(mirror)]) == 0
    assert "research" in capsys.readouterr().out  # the licence is printed
    assert default_lm_data_dir("ptb") == (root / "ptb").resolve()
    assert sorted(corpus_files(default_lm_data_dir("ptb"))) == ["test", "train", "valid"]
