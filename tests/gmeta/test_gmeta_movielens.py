"""MovieLens-100K: the atomic-file layout and the original GroupLens layout load to the same interactions, and the
cold-start split follows the protocol (newest users held out, 13-100 ratings, rating >= 4 positive)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from gmeta_trainer import GENRES, load_movielens_100k, movielens_cold_start

DATA = Path(os.environ.get("GMETA_MOVIELENS", Path(__file__).resolve().parents[2].parent / "shared" / "data" /
                           "movielens" / "ml-100k"))
pytestmark = [pytest.mark.shared_data,
              pytest.mark.skipif(not (DATA / "ml-100k.inter").exists(),
                                 reason=f"MovieLens-100K atomic files not found at {DATA} (set GMETA_MOVIELENS)")]


def _write_grouplens(dst: Path) -> None:
    """Re-write the atomic files in the GroupLens layout (u.data tab-separated, u.user/u.item pipe-separated)."""
    def rows(name):
        lines = (DATA / name).read_text(encoding="utf-8").splitlines()
        return [line.split("\t") for line in lines[1:] if line]

    (dst / "u.data").write_text("".join("\t".join(r[:4]) + "\n" for r in rows("ml-100k.inter")))
    (dst / "u.user").write_text("".join("|".join(r[:5]) + "\n" for r in rows("ml-100k.user")), encoding="latin-1")
    lines = []
    for r in rows("ml-100k.item"):
        r += [""] * (4 - len(r))
        date = f"01-Jan-{r[2]}" if r[2] else ""
        flags = ["1" if g in r[3].split(" ") else "0" for g in GENRES]
        lines.append("|".join([r[0], r[1], date, "", "http://example"] + flags) + "\n")
    (dst / "u.item").write_text("".join(lines), encoding="latin-1")


def test_atomic_and_grouplens_layouts_load_identically(tmp_path):
    _write_grouplens(tmp_path)
    a = load_movielens_100k(DATA).with_format("numpy")[:]
    b = load_movielens_100k(tmp_path).with_format("numpy")[:]
    assert len(a["user_id"]) == 100_000
    for col in a:
        np.testing.assert_array_equal(a[col], b[col], err_msg=col)
    np.testing.assert_array_equal(a["label"], (a["rating"] >= 4).astype(np.float32))
    assert a["genres"].shape == (100_000, 19)
    with pytest.raises(FileNotFoundError, match="u.data"):
        load_movielens_100k(tmp_path / "missing")


def test_cold_start_split_holds_out_the_newest_users():
    d = movielens_cold_start(DATA)
    parts = {name: getattr(d, name).with_format("numpy")[:] for name in ("train", "valid", "test")}
    users = {k: set(v["user_id"].tolist()) for k, v in parts.items()}
    assert not (users["train"] & users["test"]) and not (users["valid"] & users["test"])
    assert not (users["train"] & users["valid"])
    total = sum(len(u) for u in users.values())
    assert abs(len(users["test"]) - 0.2 * total) <= 1

    def first_ts(p):
        return {u: p["timestamp"][p["user_id"] == u].min() for u in set(p["user_id"].tolist())}

    assert max(first_ts(parts["train"]).values()) <= min(first_ts(parts["test"]).values())
    for p in parts.values():
        _, counts = np.unique(p["user_id"], return_counts=True)
        assert counts.min() >= 13 and counts.max() <= 100
    assert len(d.vocab_sizes) == len(d.sparse_columns) and d.num_dense == 19
