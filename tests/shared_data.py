"""Where the tests find a real data set: the library's own rule (``structattn.io.data_dir``:
``STRUCTATTN_DATA``, the user cache, ``../shared/data``), so the data tests run wherever a
user keeps the data. A test that needs one is marked ``@pytest.mark.data(name)`` and skipped
(or, in CI, failed) by ``conftest.py`` when it is absent."""

from __future__ import annotations

from pathlib import Path

from structattn.io import data_dir

#: where ../shared/data would be next to this checkout (only named in messages when absent)
_FALLBACK = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def real_data(name: str) -> Path:
    """The folder of the data set ``name`` (a folder name of ../shared/data), or where it
    would be next to the checkout when it is nowhere (its tests are skipped then)."""
    try:
        return data_dir(name, what=f"data set {name!r}")
    except FileNotFoundError:
        return _FALLBACK / name


class _DataRoot:
    """``DATA / "sick" / "SICK.txt"``: each data set looked up by :func:`real_data`."""

    def __truediv__(self, name: str) -> Path:
        return real_data(name)


DATA = _DataRoot()
